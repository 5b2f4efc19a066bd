//! Nested pods (`kuryr-vif-allocator --nested-trunks`) against the real parts: a real
//! kube-apiserver, kuryr-watcher and kuryr-vif-allocator under their service accounts, Keystone,
//! the real Neutron API + RPC server with the `trunk` service plugin and the ML2/OVS agent (its
//! trunk driver) on a userspace Open vSwitch, and one kuryr-binder per "VM".
//!
//! Each of the two VMs ([`kuryr_tests::nested::Vm`]) is a network namespace standing in for a
//! Nova instance: its Neutron port (bound to the agent's host) is the parent of a trunk, plugged
//! the way os-vif plugs a VLAN-aware VM — a trunk bridge `tbr-<trunk id>` on the node's Open
//! vSwitch holding the VM's tap (a veth whose other end is the VM's `eth0`), which the agent's
//! trunk driver wires to `br-int` with one patch port per subport and VLAN id. Inside the VM
//! runs its own Open vSwitch (a second ovsdb-server/ovs-vswitchd, userspace datapath, in the
//! VM's namespace) with a bridge `br-vm` on `eth0`; the VM's binder (`--nested-plug ovs`) makes
//! each pod's veth an access port of `br-vm` tagged with the pod's subport VLAN id. The
//! Kubernetes Node of each VM has the parent port's address as InternalIP: how the allocator
//! finds the node's trunk.
//!
//! 1. pods in both VMs get subports of their VM's trunk, each on a VLAN id of its own, the id
//!    in the VIF (binding VLAN); the ports carry `device_owner` `trunk:subport`;
//! 2. CNI ADD returns once the subport is ACTIVE; pods in the two VMs ping each other over IPv4
//!    and IPv6 (tagged by the VMs' bridges, untagged by the trunk bridges into `br-int`);
//! 3. the allocator killed (-9) in the middle of a burst and restarted: the earlier pods keep
//!    their subports and VLAN ids, every pod holds exactly one port, and no port is left that
//!    is neither a subport of its pod's trunk nor held;
//! 4. pods deleted: the subports are removed from the trunks (their VLAN ids free) and the
//!    ports deleted; nothing is left.
//!
//! **Untested here**: the kernel 802.1Q path of the binder (`--nested-plug vlan`:
//! `kuryr_binder::plug::vlan::add_kernel_vlan`, a VLAN device of the VM's uplink born in the
//! pod's namespace, its rollback and its DEL) — this kernel has no 802.1Q support (`ip link add
//! ... type vlan` answers "Unknown device type"). The OVS access-port path above is what carries
//! the traffic here.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kuryr_openstack::Filter;
use kuryr_openstack::neutron::Port;
use kuryr_proto::allocator::v1::{BindingDriver, Vif};
use kuryr_tests::nested::{VM_BRIDGE, Vm, vsctl};
use kuryr_tests::netns::Netns;
use kuryr_tests::neutron::{AllocatorOptions, CniPod, NeutronCluster, SLOW, cluster_tag};
use kuryr_tests::services::wait_until;

const NS: &str = "nested";
const CLUSTER_ID: &str = "e2e-nested";

struct Suite {
    c: NeutronCluster,
    vms: Vec<Vm>,
}

impl Suite {
    fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.c.admin.clone(), NS)
    }

    async fn create_pod(&self, name: &str, vm: usize) -> String {
        let mut p = self.c.pod(name);
        p.spec.as_mut().unwrap().node_name = Some(self.vms[vm].name.clone());
        self.pods().create(&PostParams::default(), &p).await.unwrap().metadata.uid.unwrap()
    }

    /// Every port carrying the cluster's tag.
    async fn tagged_ports(&self) -> Vec<Port> {
        self.c.neutron.list_ports(&Filter::new().tags(&[cluster_tag(CLUSTER_ID)])).await.unwrap()
    }
}

fn vlan_of(v: &Vif) -> u32 {
    let b = v.binding.clone().unwrap();
    assert_eq!(b.driver(), BindingDriver::Vlan, "{v:?}");
    assert!((1..=4094).contains(&b.vlan_id), "{v:?}");
    b.vlan_id
}

/// CNI ADD of a pod in its VM; returns (IPv4, IPv6) and the pod's namespace.
async fn add(vm: &Vm, name: &str, uid: &str) -> (String, String, CniPod) {
    let netns = Arc::new(Netns::new(&format!("p{}", &uid[..3])).unwrap());
    let cni = CniPod { namespace: NS.into(), name: name.into(), uid: uid.into(), netns };
    let (p, b) = (cni.clone(), vm.binder().unwrap());
    let out = tokio::task::spawn_blocking(move || p.run("ADD", &b, None, SLOW).unwrap()).await.unwrap();
    assert_eq!(
        out.code,
        0,
        "ADD {name}: {} {}\n{}\n{}",
        out.stdout,
        out.stderr,
        vm.binder().unwrap().logs(),
        vm.switch.log()
    );
    let result = out.json().unwrap();
    let ip = |v6: bool| -> String {
        let ips = result["ips"].as_array().unwrap();
        let a = ips.iter().map(|i| i["address"].as_str().unwrap()).find(|a| a.contains(':') == v6).unwrap();
        a.split('/').next().unwrap().to_string()
    };
    (ip(false), ip(true), cni)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn nested_pods_on_trunk_subports_reach_each_other_and_survive_kill_9() {
    let c = NeutronCluster::start(&[NS]).await.unwrap();
    let mut vms = Vec::new();
    for i in 1..=2 {
        vms.push(Vm::start(&c, i).await.unwrap());
    }
    let watcher = c.watcher().unwrap();
    let opts = AllocatorOptions {
        cluster_id: CLUSTER_ID.into(),
        pool_batch: 0,
        pool_min: 0,
        instance: "alloc-nested".into(),
        status_poll_min: Some("200ms".into()),
        extra: vec!["--nested-trunks".into()],
        ..AllocatorOptions::default()
    };
    let mut alloc = c.allocator(&watcher, &opts).unwrap();
    alloc.wait_ready(SLOW).await.unwrap();
    for vm in &mut vms {
        vm.start_binder(&c, &alloc, SLOW - Duration::from_secs(10)).await.unwrap();
    }
    let s = Suite { c, vms };

    // 1. Subports with VLAN ids of their own, per trunk.
    let uid_a1 = s.create_pod("a1", 0).await;
    let uid_a2 = s.create_pod("a2", 0).await;
    let uid_b1 = s.create_pod("b1", 1).await;
    let (va1, va2, vb1) = (
        alloc.wait_vif(&uid_a1, SLOW).await.unwrap(),
        alloc.wait_vif(&uid_a2, SLOW).await.unwrap(),
        alloc.wait_vif(&uid_b1, SLOW).await.unwrap(),
    );
    assert_ne!(vlan_of(&va1), vlan_of(&va2), "two pods of one VM share a VLAN id");
    for (vm, v) in [(&s.vms[0], &va1), (&s.vms[0], &va2), (&s.vms[1], &vb1)] {
        let subs = vm.subports(&s.c).await.unwrap();
        assert_eq!(
            subs.get(&v.vif_id),
            Some(&vlan_of(v)),
            "{} not on VLAN {} of {}: {subs:?}",
            v.vif_id,
            vlan_of(v),
            vm.name
        );
        let port = s.c.neutron.get_port(&v.vif_id).await.unwrap();
        assert_eq!(port.device_owner, "trunk:subport");
        assert!(port.tags.contains(&cluster_tag(CLUSTER_ID)), "{port:?}");
        assert_eq!(port.device_id, v.pod.as_ref().unwrap().uid);
    }

    // 2. Traffic between the VMs: ADD returns once the subports are ACTIVE.
    let (a1_v4, a1_v6, a1) = add(&s.vms[0], "a1", &uid_a1).await;
    let (b1_v4, b1_v6, b1) = add(&s.vms[1], "b1", &uid_b1).await;
    for uid in [&va1.vif_id, &vb1.vif_id] {
        let p = s.c.neutron.get_port(uid).await.unwrap();
        assert_eq!(
            (p.status.as_str(), p.binding_host_id.as_deref()),
            ("ACTIVE", Some(s.c.node.host.as_str())),
            "subports are bound to the parent's host"
        );
    }
    let tags = vsctl(&s.vms[0].switch.db(), &["--columns=name,tag", "find", "Port", "tag!=[]"]).unwrap();
    assert!(tags.contains(&vlan_of(&va1).to_string()), "the VM bridge's access port is tagged: {tags}");
    a1.netns.wait_ping(&b1_v4, Duration::from_secs(60)).await.unwrap();
    b1.netns.wait_ping(&a1_v4, Duration::from_secs(60)).await.unwrap();
    a1.netns.wait_ping(&b1_v6, Duration::from_secs(60)).await.unwrap();
    b1.netns.wait_ping(&a1_v6, Duration::from_secs(60)).await.unwrap();
    eprintln!("nested pods a1 (VLAN {}) and b1 (VLAN {}) reach each other", vlan_of(&va1), vlan_of(&vb1));

    // 3. kill -9 in the middle of a burst, then recovery from Neutron.
    let mut burst = Vec::new();
    for (i, vm) in [0usize, 1, 1, 0, 1].into_iter().enumerate() {
        burst.push((format!("k{i}"), s.create_pod(&format!("k{i}"), vm).await));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    alloc.proc.kill().await.unwrap();
    drop(alloc);
    let alloc = s.c.allocator(&watcher, &opts).unwrap();
    alloc.wait_ready(SLOW).await.unwrap();
    assert_eq!(alloc.wait_vif(&uid_a1, SLOW).await.unwrap().vif_id, va1.vif_id);
    assert_eq!(
        vlan_of(&alloc.wait_vif(&uid_a2, SLOW).await.unwrap()),
        vlan_of(&va2),
        "a VLAN id changed across the restart"
    );
    assert_eq!(alloc.wait_vif(&uid_b1, SLOW).await.unwrap().vif_id, vb1.vif_id);
    let mut all: Vec<(String, usize)> = vec![(uid_a1.clone(), 0), (uid_a2.clone(), 0), (uid_b1.clone(), 1)];
    for ((_, uid), vm) in burst.iter().zip([0usize, 1, 1, 0, 1]) {
        all.push((uid.clone(), vm));
    }
    let mut want: BTreeMap<usize, BTreeMap<String, u32>> = BTreeMap::new();
    for (uid, vm) in &all {
        let v = alloc.wait_vif(uid, SLOW).await.unwrap();
        want.entry(*vm).or_default().insert(v.vif_id.clone(), vlan_of(&v));
    }
    wait_until("exactly one subport per pod, on its VM's trunk, nothing else", SLOW, || async {
        for (i, vm) in s.vms.iter().enumerate() {
            let subs = vm.subports(&s.c).await?;
            anyhow::ensure!(subs == want[&i], "trunk of {}: {subs:?}, want {:?}", vm.name, want[&i]);
        }
        let ports = s.tagged_ports().await;
        anyhow::ensure!(ports.len() == all.len(), "{} tagged ports for {} pods", ports.len(), all.len());
        for (uid, _) in &all {
            let n = ports.iter().filter(|p| &p.device_id == uid).count();
            anyhow::ensure!(n == 1, "pod {uid} holds {n} ports");
        }
        Ok(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", alloc.proc.logs()));
    a1.netns.wait_ping(&b1_v4, Duration::from_secs(60)).await.unwrap();
    eprintln!("after kill -9: {} pods, VLAN ids {want:?}", all.len());

    // 4. Deletion: subports removed from the trunks, their VLAN ids free, ports deleted.
    for (vm, cni) in [(&s.vms[0], &a1), (&s.vms[1], &b1)] {
        let (p, b) = (cni.clone(), vm.binder().unwrap());
        let out = tokio::task::spawn_blocking(move || p.run("DEL", &b, None, SLOW).unwrap()).await.unwrap();
        assert_eq!(out.code, 0, "DEL: {} {}", out.stdout, out.stderr);
    }
    let grace0 = DeleteParams { grace_period_seconds: Some(0), ..DeleteParams::default() };
    for p in s.pods().list(&ListParams::default()).await.unwrap().items {
        s.pods().delete(&p.metadata.name.unwrap(), &grace0).await.unwrap();
    }
    wait_until("the subports and their ports gone", SLOW, || async {
        for vm in &s.vms {
            let subs = vm.subports(&s.c).await?;
            anyhow::ensure!(subs.is_empty(), "trunk of {} still has {subs:?}", vm.name);
        }
        let left: BTreeSet<String> = s.tagged_ports().await.into_iter().map(|p| p.id).collect();
        anyhow::ensure!(left.is_empty(), "ports left: {left:?}");
        let pods = s.pods().list(&ListParams::default()).await?.items.len();
        anyhow::ensure!(pods == 0, "{pods} pods left");
        Ok(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", alloc.proc.logs()));
    for vm in &s.vms {
        let ports = vsctl(&vm.switch.db(), &["list-ports", VM_BRIDGE]).unwrap();
        assert_eq!(ports.trim(), "eth0", "pod ports left on {}'s bridge", vm.name);
    }
}

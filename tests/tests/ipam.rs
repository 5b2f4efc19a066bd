//! The embedded IPAM against a real kube-apiserver: the CRDs from `deploy/crds/` as committed,
//! node-local blocks and gateways, idempotency, release, dual-stack, exhaustion, and the proof
//! that two independent allocators never hand out one address twice.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;
use std::time::Instant;

use futures::future::join_all;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kuryr_tests::ipam::{cluster, phase, pod};
use kuryr_vif_allocator::backend::ipam::{Allocation, IpamStore, StoreError};
use kuryr_vif_allocator::k8s::crd::{self, AddressBlock, PodNetwork, PodNetworkSpec, RouteSpec};

fn ips(a: &Allocation) -> Vec<(String, String)> {
    a.vif.ips.iter().map(|c| (c.address.to_string(), c.gateway.to_string())).collect()
}

fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
    list.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect()
}

#[tokio::test]
async fn allocates_node_local_addresses_idempotently_and_releases_them() {
    let (env, client) = cluster().await.unwrap();
    let store = IpamStore::new(client.clone());
    let spec = PodNetworkSpec {
        routes: vec![RouteSpec { destination: "10.96.0.0/12".into(), gateway: None }],
        ..PodNetworkSpec::new(["10.244.0.0/16"])
    };
    let net = store.ensure_network("pods", &spec).await.unwrap();
    // The API server applied the schema defaults the same way the Rust type does.
    assert_eq!(net.spec, spec);
    let status = Api::<PodNetwork>::all(client.clone()).get_status("pods").await.unwrap().status.unwrap();
    assert_eq!((status.allocated_blocks, status.conditions[0].status.as_str()), (0, "True"));

    // Each node gets its own block; the block's first usable address is that node's gateway.
    let a1 = store.allocate("pods", "node-a", &pod(1)).await.unwrap();
    let b1 = store.allocate("pods", "node-b", &pod(2)).await.unwrap();
    let a2 = store.allocate("pods", "node-a", &pod(3)).await.unwrap();
    assert_eq!(ips(&a1), pairs(&[("10.244.0.2/24", "10.244.0.1")]));
    assert_eq!(ips(&b1), pairs(&[("10.244.1.2/24", "10.244.1.1")]));
    assert_eq!(ips(&a2), pairs(&[("10.244.0.3/24", "10.244.0.1")]));
    assert_eq!(a1.vif.mac.to_string(), "0a:58:0a:f4:00:02");
    assert_eq!(a1.vif_id, "pods/10.244.0.2");
    assert_eq!((a1.vif.mtu, a1.vif.bridge.as_str()), (1500, "kuryr0"));
    let route = a1.vif.routes[0];
    assert_eq!(
        (route.destination.to_string(), route.gateway.unwrap().to_string()),
        ("10.96.0.0/12".into(), "10.244.0.1".into())
    );
    assert!(!a1.existing);

    // Idempotent: the same pod gets the same VIF back, and nothing is written.
    let again = store.allocate("pods", "node-a", &pod(1)).await.unwrap();
    assert!(again.existing);
    assert_eq!(Allocation { existing: false, ..again }, a1);

    let blocks = store.node_blocks("pods").await.unwrap();
    let shown: BTreeMap<_, Vec<String>> =
        blocks.into_iter().map(|(n, c)| (n, c.iter().map(|c| c.to_string()).collect())).collect();
    assert_eq!(
        shown,
        BTreeMap::from([
            ("node-a".into(), vec!["10.244.0.0/24".into()]),
            ("node-b".into(), vec!["10.244.1.0/24".into()])
        ])
    );
    // Operators find a node's blocks the way the store does, by the selectable fields.
    let listed =
        env.kubectl(&["get", "addressblocks", "--field-selector=spec.network=pods,spec.node=node-b", "-o", "name"]);
    assert_eq!(listed.await.unwrap().trim(), "addressblock.kuryr.openstack.org/pods-10-244-1-0-24");
    let block_api: Api<AddressBlock> = Api::all(client.clone());
    let block = block_api.get("pods-10-244-0-0-24").await.unwrap();
    assert_eq!((block.spec.node.as_str(), block.spec.cidr.as_str()), ("node-a", "10.244.0.0/24"));
    let st = block.status.unwrap();
    assert_eq!(st.used, 2);
    assert_eq!(st.allocations["10.244.0.2"].uid, "uid-1");
    assert_eq!(st.allocations["10.244.0.2"].mac, "0a:58:0a:f4:00:02");
    assert_eq!(st.allocations["10.244.0.3"].name, "pod-3");
    // The allocations are one field for the API server's field tracking, not one per address.
    let status_fields: Vec<serde_json::Value> = block
        .metadata
        .managed_fields
        .iter()
        .flatten()
        .filter(|m| m.subresource.as_deref() == Some("status"))
        .filter_map(|m| m.fields_v1.as_ref().map(|f| f.0.clone()))
        .collect();
    assert!(!status_fields.is_empty(), "no managedFields entry for the status: {:?}", block.metadata.managed_fields);
    for fields in &status_fields {
        assert_eq!(fields["f:status"]["f:allocations"], serde_json::json!({}), "{fields}");
    }
    let status = Api::<PodNetwork>::all(client.clone()).get_status("pods").await.unwrap().status.unwrap();
    assert_eq!(status.allocated_blocks, 2);

    // A block's spec is immutable (CEL rule in the CRD): it can never move to another node.
    let moved = block_api
        .patch(
            "pods-10-244-0-0-24",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"node": "node-b"}})),
        )
        .await;
    assert!(matches!(moved, Err(kube::Error::Api(s)) if s.code == 422), "a block's spec changed");

    // Release is idempotent and frees the address; the next allocation moves on (next-fit), so
    // a just-released address is not reused at once.
    assert!(store.release("pods", "uid-1").await.unwrap());
    assert!(!store.release("pods", "uid-1").await.unwrap());
    assert!(!store.release_on_node("pods", "node-a", "uid-1").await.unwrap());
    assert!(!store.release("pods", "never-allocated").await.unwrap());
    let st = block_api.get_status("pods-10-244-0-0-24").await.unwrap().status.unwrap();
    assert_eq!((st.used, st.allocations.contains_key("10.244.0.2")), (1, false));
    let a4 = store.allocate("pods", "node-a", &pod(4)).await.unwrap();
    assert_eq!(ips(&a4), pairs(&[("10.244.0.4/24", "10.244.0.1")]));
    // A released pod that comes back (same uid) is a new allocation.
    let a1b = store.allocate("pods", "node-a", &pod(1)).await.unwrap();
    assert_eq!(ips(&a1b), pairs(&[("10.244.0.5/24", "10.244.0.1")]));

    // The API server does not check the entries (their schema cost it more than anything else in
    // a status write): one of another shape, written behind the store's back, keeps its address
    // taken and the block usable.
    block_api
        .patch_status(
            "pods-10-244-1-0-24",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"status": {"allocations": {"10.244.1.3": "not an entry"}}})),
        )
        .await
        .unwrap();
    let b2 = store.allocate("pods", "node-b", &pod(5)).await.unwrap();
    assert_eq!(ips(&b2), pairs(&[("10.244.1.4/24", "10.244.1.1")]));
    assert!(store.release("pods", "uid-2").await.unwrap());
    let st = block_api.get_status("pods-10-244-1-0-24").await.unwrap().status.unwrap();
    assert_eq!(st.allocations.keys().collect::<Vec<_>>(), ["10.244.1.3", "10.244.1.4"]);

    // Clear errors for missing and invalid networks.
    let err = store.allocate("nope", "node-a", &pod(9)).await.unwrap_err();
    assert!(matches!(err, StoreError::NetworkNotFound(_)), "{err}");
    let bad = PodNetworkSpec::new(["10.1.0.0/16", "10.2.0.0/16"]);
    assert!(matches!(store.ensure_network("bad", &bad).await, Err(StoreError::InvalidNetwork { .. })));
    // Written behind the store's back (the schema alone allows two CIDRs): refused at allocation.
    Api::<PodNetwork>::all(client.clone()).create(&PostParams::default(), &PodNetwork::new("bad", bad)).await.unwrap();
    let err = store.allocate("bad", "node-a", &pod(9)).await.unwrap_err();
    assert!(matches!(err, StoreError::InvalidNetwork { .. }), "{err}");
    let st = store.refresh_network_status("bad").await.unwrap();
    assert_eq!((st.conditions[0].status.as_str(), st.conditions[0].reason.as_str()), ("False", "InvalidSpec"));
    assert_eq!(st.message.as_deref(), Some("the network has more than one IPv4 CIDR"));
    // Fixed: Ready again, and the old message is gone from the stored status.
    store.ensure_network("bad", &PodNetworkSpec::new(["10.1.0.0/16"])).await.unwrap();
    let st = Api::<PodNetwork>::all(client.clone()).get_status("bad").await.unwrap().status.unwrap();
    assert_eq!((st.conditions[0].status.as_str(), st.message), ("True", None));
    assert_eq!(store.stats().existing, 1);
}

#[tokio::test]
async fn dual_stack_ipv6_only_and_exhaustion() {
    let (_env, client) = cluster().await.unwrap();
    let store = IpamStore::new(client.clone());

    // Dual-stack: one address per family, each from the node's block of that family, and the
    // MAC from the IPv4 address.
    store.ensure_network("dual", &PodNetworkSpec::new(["10.20.0.0/16", "fd00:20::/64"])).await.unwrap();
    let a = store.allocate("dual", "node-a", &pod(1)).await.unwrap();
    let b = store.allocate("dual", "node-b", &pod(2)).await.unwrap();
    assert_eq!(ips(&a), pairs(&[("10.20.0.2/24", "10.20.0.1"), ("fd00:20::2/112", "fd00:20::1")]));
    assert_eq!(ips(&b), pairs(&[("10.20.1.2/24", "10.20.1.1"), ("fd00:20::1:2/112", "fd00:20::1:1")]));
    assert_eq!(a.vif.mac.to_string(), "0a:58:0a:14:00:02");
    assert_eq!(
        a.addresses.iter().map(|x| x.block_name.as_str()).collect::<Vec<_>>(),
        ["dual-10-20-0-0-24", "dual-fd00-20---112"]
    );
    let blocks = store.node_blocks("dual").await.unwrap();
    assert_eq!(blocks["node-a"].len(), 2);
    assert_eq!(
        blocks["node-b"].iter().map(|c| c.to_string()).collect::<Vec<_>>(),
        ["10.20.1.0/24", "fd00:20::1:0/112"]
    );
    assert!(store.release("dual", "uid-1").await.unwrap());
    let st = Api::<AddressBlock>::all(client.clone()).get_status("dual-fd00-20---112").await.unwrap().status.unwrap();
    assert!(st.allocations.is_empty());

    // IPv6-only: the MAC comes from the low 32 bits of the address.
    let spec = PodNetworkSpec { ipv6_block_prefix: 124, ..PodNetworkSpec::new(["fd00:30::/120"]) };
    store.ensure_network("v6", &spec).await.unwrap();
    let v6 = store.allocate("v6", "node-a", &pod(1)).await.unwrap();
    assert_eq!(ips(&v6), pairs(&[("fd00:30::2/124", "fd00:30::1")]));
    assert_eq!(v6.vif.mac.to_string(), "0a:58:00:00:00:02");

    // A /28 in /29 blocks: two blocks of five pod addresses (network, gateway and broadcast
    // are never handed out). node-a fills its block, claims the second, then runs dry.
    let tiny = PodNetworkSpec { ipv4_block_prefix: 29, ..PodNetworkSpec::new(["10.30.0.0/28"]) };
    store.ensure_network("tiny", &tiny).await.unwrap();
    let mut got = BTreeSet::new();
    for i in 0..10 {
        let a = store.allocate("tiny", "node-a", &pod(i)).await.unwrap();
        got.insert(a.addresses[0].address.to_string());
    }
    let want: BTreeSet<String> = [2, 3, 4, 5, 6, 10, 11, 12, 13, 14].iter().map(|i| format!("10.30.0.{i}")).collect();
    assert_eq!(got, want);
    let err = store.allocate("tiny", "node-a", &pod(10)).await.unwrap_err();
    assert!(matches!(err, StoreError::Exhausted { .. }), "{err}");
    assert_eq!(
        err.to_string(),
        "pod network \"tiny\" is exhausted (10.30.0.0/28): node \"node-a\" has no free address in its blocks \
         and no unclaimed /29 block is left"
    );
    let err = store.allocate("tiny", "node-b", &pod(11)).await.unwrap_err();
    assert!(matches!(err, StoreError::Exhausted { .. }), "{err}");
    // Released addresses go back to the pool.
    let freed = store.allocate("tiny", "node-a", &pod(3)).await.unwrap().addresses[0].address;
    assert!(store.release("tiny", "uid-3").await.unwrap());
    let reused = store.allocate("tiny", "node-a", &pod(12)).await.unwrap();
    assert_eq!(reused.addresses[0].address, freed);
    assert_eq!(store.stats().blocks_claimed, 4 + 1 + 2, "dual: two nodes × two families; v6: one; tiny: two");

    // Dual-stack where IPv6 runs out first: the IPv4 address this call took is given back.
    let half = PodNetworkSpec { ipv6_block_prefix: 124, ..PodNetworkSpec::new(["10.40.0.0/24", "fd00:40::/124"]) };
    store.ensure_network("half", &half).await.unwrap();
    for i in 0..14 {
        store.allocate("half", "node-a", &pod(i)).await.unwrap();
    }
    let err = store.allocate("half", "node-a", &pod(14)).await.unwrap_err();
    assert!(matches!(err, StoreError::Exhausted { .. }), "{err}");
    let st = Api::<AddressBlock>::all(client).get_status("half-10-40-0-0-24").await.unwrap().status.unwrap();
    assert_eq!(st.used, 14);
    assert!(st.allocations.values().all(|a| a.uid != "uid-14"), "the IPv4 address of the failed pod leaked");
}

/// Two allocators with their own clients (as two processes would be) allocate 200 pods on two
/// nodes at once. Every address must be handed out once, the blocks must record exactly the
/// returned allocations, and the resourceVersion checks must have refused some writes.
#[tokio::test]
async fn two_allocators_never_hand_out_an_address_twice() {
    const PODS: usize = 200;
    let (env, client) = cluster().await.unwrap();
    let stores = [IpamStore::new(env.client().await.unwrap()), IpamStore::new(env.client().await.unwrap())];
    // /26 blocks (61 pods each): each node needs two blocks, so block claims race as well.
    let spec = PodNetworkSpec { ipv4_block_prefix: 26, ..PodNetworkSpec::new(["10.50.0.0/16"]) };
    stores[0].ensure_network("race", &spec).await.unwrap();

    let node = |i: usize| format!("node-{}", i % 2);
    let started = Instant::now();
    let results = phase(
        "200 concurrent allocations",
        join_all((0..PODS).map(|i| {
            let (store, node, pod) = (&stores[(i / 2) % 2], node(i), pod(i));
            async move { store.allocate("race", &node, &pod).await }
        })),
    )
    .await;
    let took = started.elapsed();
    let allocations: Vec<Allocation> = results.into_iter().map(Result::unwrap).collect();

    // Distinct addresses and MACs, each inside a block of the pod's own node.
    let addresses: BTreeSet<IpAddr> = allocations.iter().map(|a| a.addresses[0].address).collect();
    assert_eq!(addresses.len(), PODS, "an address was handed out twice");
    let macs: BTreeSet<String> = allocations.iter().map(|a| a.vif.mac.to_string()).collect();
    assert_eq!(macs.len(), PODS, "a MAC was handed out twice");
    let node_blocks = stores[1].node_blocks("race").await.unwrap();
    for (i, a) in allocations.iter().enumerate() {
        let owned = &node_blocks[&node(i)];
        assert!(
            owned.iter().any(|b| b.contains(&a.addresses[0].address)),
            "{} not in a block of {}",
            a.vif_id,
            node(i)
        );
        assert!(!a.existing);
    }
    assert_eq!(node_blocks.values().map(Vec::len).collect::<Vec<_>>(), [2, 2]);

    // The blocks record exactly what was returned: no address twice, no pod twice, nothing else.
    let recorded = recorded_allocations(&client).await;
    let returned: HashMap<String, IpAddr> =
        allocations.iter().map(|a| (a.pod.uid.clone(), a.addresses[0].address)).collect();
    assert_eq!(recorded, returned);

    let (s0, s1) = (stores[0].stats(), stores[1].stats());
    let conflicts = s0.conflicts + s1.conflicts;
    eprintln!(
        "{PODS} pods by two allocators in {took:?}: {conflicts} write conflicts retried, \
         {} block claims lost; store A {s0:?}; store B {s1:?}",
        s0.claim_races + s1.claim_races
    );
    assert_eq!(s0.allocations + s1.allocations, PODS as u64);
    assert_eq!(s0.blocks_claimed + s1.blocks_claimed, 4);
    // The group commit per node makes collisions rarer: a refused write or a lost block claim
    // shows that the two stores did race.
    assert!(
        conflicts + s0.claim_races + s1.claim_races > 0,
        "the allocators never collided, so optimistic concurrency was not exercised"
    );

    // Asked again, through the other store: the same addresses, nothing written.
    let again = phase(
        "200 repeated allocations",
        join_all((0..PODS).map(|i| {
            let (store, node, pod) = (&stores[1 - (i / 2) % 2], node(i), pod(i));
            async move { store.allocate("race", &node, &pod).await.unwrap() }
        })),
    )
    .await;
    for (first, second) in allocations.iter().zip(&again) {
        assert!(second.existing);
        assert_eq!(first.addresses, second.addresses);
    }

    // Concurrent release through both stores empties every block.
    let released = phase(
        "200 concurrent releases",
        join_all((0..PODS).map(|i| {
            let (store, node, uid) = (&stores[i % 2], node(i), pod(i).uid);
            async move {
                if i % 4 < 2 {
                    store.release("race", &uid).await
                } else {
                    store.release_on_node("race", &node, &uid).await
                }
                .unwrap()
            }
        })),
    )
    .await;
    assert!(released.into_iter().all(|r| r));
    assert!(recorded_allocations(&client).await.is_empty());
}

/// Every allocation in the blocks of network `race`, uid → address; panics on any duplicate.
async fn recorded_allocations(client: &kube::Client) -> HashMap<String, IpAddr> {
    let blocks = Api::<AddressBlock>::all(client.clone()).list(&Default::default()).await.unwrap();
    let mut by_uid = HashMap::new();
    let mut seen = BTreeSet::new();
    for b in blocks.items.into_iter().filter(|b| b.spec.network == "race") {
        let status = b.status.unwrap_or_default();
        assert_eq!(status.used as usize, status.allocations.len(), "used is off in {}", b.spec.cidr);
        for (ip, holder) in status.allocations {
            let ip: IpAddr = ip.parse().unwrap();
            assert!(seen.insert(ip), "{ip} recorded twice");
            assert!(by_uid.insert(holder.uid.clone(), ip).is_none(), "{} holds two addresses", holder.uid);
        }
    }
    by_uid
}

/// A pod holding addresses in two blocks of its node, as when two allocators raced for it
/// (the second entry written straight to the block, as the other allocator would): `holds`
/// reads the blocks as they are now, and `release_addresses` gives back only what it lists,
/// and only when the pod holds it.
#[tokio::test]
async fn holds_reads_now_and_release_addresses_frees_only_the_listed_ones() {
    let (_env, client) = cluster().await.unwrap();
    let store = IpamStore::new(client.clone());
    let spec = PodNetworkSpec { ipv4_block_prefix: 28, ..PodNetworkSpec::new(["10.60.0.0/24"]) };
    store.ensure_network("dup", &spec).await.unwrap();
    let first = store.allocate("dup", "node-0", &pod(0)).await.unwrap().addresses[0].address;
    // Fill the first block until an allocation lands in a second one.
    let second_block: IpAddr = "10.60.0.16".parse().unwrap();
    let mut other = None;
    for i in 1..40 {
        let addr = store.allocate("dup", "node-0", &pod(i)).await.unwrap().addresses[0].address;
        if addr >= second_block {
            other = Some((i, addr));
            break;
        }
    }
    let (k, theirs) = other.expect("no allocation reached a second block");
    assert!(theirs < "10.60.0.29".parse::<IpAddr>().unwrap(), "{theirs}");
    let blocks: Api<AddressBlock> = Api::all(client.clone());
    let name = "dup-10-60-0-16-28";
    let mut block = blocks.get_status(name).await.unwrap();
    let dup: IpAddr = "10.60.0.29".parse().unwrap();
    let status = block.status.as_mut().unwrap();
    assert!(!status.allocations.contains_key("10.60.0.29"));
    let entry = crd::BlockAllocation {
        namespace: "ns1".into(),
        name: "pod-0".into(),
        uid: "uid-0".into(),
        mac: "0a:58:0a:3c:00:1d".into(),
    };
    status.allocations.insert(dup.to_string(), entry);
    status.used += 1;
    blocks.replace_status(name, &PostParams::default(), &block).await.unwrap();

    let holds = |addrs: Vec<IpAddr>| {
        let store = &store;
        async move { store.holds("dup", "node-0", "uid-0", &addrs).await.unwrap() }
    };
    assert!(holds(vec![first]).await && holds(vec![dup]).await && holds(vec![first, dup]).await);
    assert!(!holds(vec![first, theirs]).await, "another pod's address counted as held");
    assert!(!holds(vec![]).await);

    // Only the listed address goes, through the store's stale copy of the block (a 409, re-read).
    assert!(store.release_addresses("dup", "node-0", "uid-0", &[dup]).await.unwrap());
    let st = blocks.get_status(name).await.unwrap().status.unwrap();
    assert!(!st.allocations.contains_key("10.60.0.29"));
    assert_eq!(st.used as usize, st.allocations.len());
    assert_eq!(st.allocations[&theirs.to_string()].uid, format!("uid-{k}"));
    assert!(holds(vec![first]).await && !holds(vec![dup]).await);
    // Nothing held: nothing freed; another pod's address is never freed for this one.
    assert!(!store.release_addresses("dup", "node-0", "uid-0", &[dup]).await.unwrap());
    assert!(!store.release_addresses("dup", "node-0", "uid-0", &[theirs]).await.unwrap());
    assert!(store.holds("dup", "node-0", &format!("uid-{k}"), &[theirs]).await.unwrap());
    // The pod keeps its first address.
    let again = store.allocate("dup", "node-0", &pod(0)).await.unwrap();
    assert!(again.existing);
    assert_eq!(again.addresses[0].address, first);
}

//! The embedded IPAM's batches and its copy of a node's blocks, against a real kube-apiserver:
//! a burst for one node costs a handful of block writes, not one per pod; and a copy made stale
//! by another allocator (another process's allocations and releases) never leads to an address
//! handed out twice, an allocation answered from a freed entry, or a release that misses.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::time::Duration;

use futures::future::join_all;
use kube::api::Api;
use kuryr_tests::ipam::{cluster, phase, pod};
use kuryr_vif_allocator::backend::ipam::{IpamStore, StoreConfig};
use kuryr_vif_allocator::k8s::crd::{AddressBlock, PodNetworkSpec};

/// Every entry of the network's blocks as (address, uid); panics on an address recorded twice.
async fn recorded(client: &kube::Client, network: &str) -> BTreeSet<(IpAddr, String)> {
    let blocks = Api::<AddressBlock>::all(client.clone()).list(&Default::default()).await.unwrap();
    let mut out = BTreeSet::new();
    let mut seen = BTreeSet::new();
    for b in blocks.items.into_iter().filter(|b| b.spec.network == network) {
        let status = b.status.unwrap_or_default();
        assert_eq!(status.used as usize, status.allocations.len(), "used is off in {}", b.spec.cidr);
        for (ip, holder) in status.allocations {
            let ip: IpAddr = ip.parse().unwrap();
            assert!(seen.insert(ip), "{ip} recorded twice");
            out.insert((ip, holder.uid));
        }
    }
    out
}

#[tokio::test]
async fn a_burst_for_one_node_is_written_in_batches() {
    const PODS: usize = 120;
    let (_env, client) = cluster().await.unwrap();
    let store = IpamStore::new(client.clone());
    store.ensure_network("burst", &PodNetworkSpec::new(["10.60.0.0/16", "fd00:60::/64"])).await.unwrap();

    let results = phase(
        "a burst of allocations",
        join_all((0..PODS).map(|i| {
            let store = &store;
            async move { store.allocate("burst", "node-a", &pod(i)).await }
        })),
    )
    .await;
    let allocations: Vec<_> = results.into_iter().map(Result::unwrap).collect();
    let v4: BTreeSet<IpAddr> = allocations.iter().map(|a| a.addresses[0].address).collect();
    let v6: BTreeSet<IpAddr> = allocations.iter().map(|a| a.addresses[1].address).collect();
    assert_eq!((v4.len(), v6.len()), (PODS, PODS), "an address was handed out twice");
    let stats = store.stats();
    eprintln!("{PODS} dual-stack allocations for one node: {stats:?}");
    assert_eq!(stats.allocations, PODS as u64);
    // One write per family per batch; the first batch is usually 1 pod, the second the rest.
    assert!(
        stats.block_writes <= 2 * stats.batches && stats.batches < (PODS as u64) / 4,
        "allocations were not batched: {stats:?}"
    );
    let want: BTreeSet<(IpAddr, String)> =
        allocations.iter().flat_map(|a| a.addresses.iter().map(|x| (x.address, a.pod.uid.clone()))).collect();
    assert_eq!(recorded(&client, "burst").await, want);

    // Releases batch the same way and empty the blocks.
    let before = store.stats();
    let released = phase(
        "a burst of releases",
        join_all((0..PODS).map(|i| {
            let store = &store;
            async move { store.release_on_node("burst", "node-a", &pod(i).uid).await.unwrap() }
        })),
    )
    .await;
    assert!(released.into_iter().all(|r| r));
    let after = store.stats();
    assert_eq!(after.releases - before.releases, PODS as u64);
    assert!(after.block_writes - before.block_writes < (PODS as u64) / 2, "releases were not batched: {after:?}");
    assert!(recorded(&client, "burst").await.is_empty());
}

/// Two stores as two allocator processes would hold them: A keeps its copy of a node's blocks
/// for an hour, so that only the safety rules (not expiry) keep it right; B changes the blocks
/// behind A's back.
async fn two_stores(env: &kuryr_tests::kube::KubeEnv) -> (IpamStore, IpamStore) {
    let config = StoreConfig { blocks_ttl: Duration::from_secs(3600), ..StoreConfig::default() };
    (IpamStore::with_config(env.client().await.unwrap(), config), IpamStore::new(env.client().await.unwrap()))
}

/// Store A keeps a copy of node-a's blocks; store B (another process) changes them behind its
/// back. A must notice at the write (409) or confirm with a fresh read, never trust the copy.
#[tokio::test]
async fn a_stale_copy_never_decides_alone() {
    let (env, client) = cluster().await.unwrap();
    let (a, b) = two_stores(&env).await;
    let spec = PodNetworkSpec { ipv4_block_prefix: 28, ..PodNetworkSpec::new(["10.70.0.0/24"]) };
    a.ensure_network("stale", &spec).await.unwrap();

    // A allocates and keeps its copy; B then writes the same block.
    let first = a.allocate("stale", "node-a", &pod(0)).await.unwrap();
    let by_b = b.allocate("stale", "node-a", &pod(1)).await.unwrap();
    assert_ne!(first.addresses[0].address, by_b.addresses[0].address);
    // A's copy is stale: its write is refused (409), it re-reads, and it does not take B's address.
    let conflicts = a.stats().conflicts;
    let second = a.allocate("stale", "node-a", &pod(2)).await.unwrap();
    assert!(a.stats().conflicts > conflicts, "the stale copy was not refused by the API server");
    let addrs: BTreeSet<IpAddr> = [&first, &by_b, &second].iter().map(|x| x.addresses[0].address).collect();
    assert_eq!(addrs.len(), 3);

    // B releases pod 0, which A's copy still shows as allocated. A asked again for pod 0 must
    // not answer from the copy (the address is free now): it records a new one.
    assert!(b.release_on_node("stale", "node-a", "uid-0").await.unwrap());
    let again = a.allocate("stale", "node-a", &pod(0)).await.unwrap();
    assert!(!again.existing, "answered from a freed entry of the stale copy");
    assert!(recorded(&client, "stale").await.contains(&(again.addresses[0].address, "uid-0".into())));

    // B allocates pod 3, which A's copy does not show. A releasing pod 3 must not say "holds
    // nothing" from the copy.
    let three = b.allocate("stale", "node-a", &pod(3)).await.unwrap();
    assert!(a.release_on_node("stale", "node-a", "uid-3").await.unwrap(), "the release missed pod 3");
    assert!(!recorded(&client, "stale").await.iter().any(|(ip, _)| *ip == three.addresses[0].address));

    // B fills node-a's first block (/28: 13 pod addresses) and claims a second one; A's copy
    // knows only the first. A still hands out only free addresses, from the new block.
    let mut i = 10;
    while b.node_blocks("stale").await.unwrap()["node-a"].len() < 2 {
        b.allocate("stale", "node-a", &pod(i)).await.unwrap();
        i += 1;
    }
    let late = a.allocate("stale", "node-a", &pod(99)).await.unwrap();
    let all = recorded(&client, "stale").await;
    assert!(all.contains(&(late.addresses[0].address, "uid-99".into())));
    assert_eq!(all.iter().filter(|(_, uid)| uid == "uid-99").count(), 1);
}

/// Dual-stack batches send both families' block writes at once. When one of them loses a
/// conflict (another allocator changed that block) and the other is written, the pod is served
/// again from a fresh read: what was written for it is given back first, so that it holds one
/// address per family and both entries record the MAC of the IPv4 address it ends up with.
#[tokio::test]
async fn a_pod_is_served_whole_when_one_family_loses_a_conflict() {
    let (env, client) = cluster().await.unwrap();
    let (a, b) = two_stores(&env).await;
    a.ensure_network("dual", &PodNetworkSpec::new(["10.80.0.0/16", "fd00:80::/64"])).await.unwrap();

    // A reads and keeps both blocks; B then changes the IPv6 block alone (it gives back pod 0's
    // IPv6 address), so A's next IPv4 write succeeds and its IPv6 write loses.
    let first = a.allocate("dual", "node-a", &pod(0)).await.unwrap();
    assert!(b.release_addresses("dual", "node-a", "uid-0", &[first.addresses[1].address]).await.unwrap());
    let before = a.stats();
    let second = a.allocate("dual", "node-a", &pod(2)).await.unwrap();
    let after = a.stats();
    assert!(after.conflicts > before.conflicts, "the stale copy was not refused by the API server");
    // Both writes at once, the IPv4 one given back, then one family at a time: 5 writes.
    assert_eq!(after.block_writes - before.block_writes, 5, "{before:?} → {after:?}");
    assert_eq!(second.addresses.len(), 2);

    let blocks = Api::<AddressBlock>::all(client.clone()).list(&Default::default()).await.unwrap();
    let entries: Vec<(IpAddr, String, String)> = blocks
        .items
        .into_iter()
        .filter(|b| b.spec.network == "dual")
        .flat_map(|b| b.status.unwrap_or_default().allocations)
        .map(|(ip, holder)| (ip.parse().unwrap(), holder.uid, holder.mac))
        .collect();
    let of = |uid: &str| entries.iter().filter(|(_, u, _)| u == uid).collect::<Vec<_>>();
    // One entry per family for pod 2, at the addresses it was given, with one MAC.
    let mine = of("uid-2");
    assert_eq!(mine.len(), 2, "pod 2 holds {mine:?}");
    let addresses: BTreeSet<IpAddr> = mine.iter().map(|(ip, _, _)| *ip).collect();
    assert_eq!(addresses, second.addresses.iter().map(|x| x.address).collect());
    assert_eq!(mine[0].2, mine[1].2, "the entries of pod 2 record two MACs");
    assert_eq!(mine[0].2, second.vif.mac.to_string());
    assert_eq!(of("uid-0").len(), 1);
    assert!(!addresses.contains(&first.addresses[0].address));
    // And no address is recorded twice (`recorded` checks).
    assert_eq!(recorded(&client, "dual").await.len(), 3);
}

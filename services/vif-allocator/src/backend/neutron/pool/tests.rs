//! The pool bookkeeping, tested on its own: no Neutron.
#![allow(clippy::unwrap_used)]

use super::*;

fn port(id: &str) -> Port {
    Port { id: id.into(), ..Default::default() }
}

fn key(node: &str) -> PoolKey {
    PoolKey::new(node, "proj", "net", vec!["sg-b".into(), "sg-a".into(), "sg-b".into()])
}

const LIMITS: Limits = Limits { min: 3, batch: 5, max: 8 };

#[test]
fn keys_sort_their_security_groups() {
    assert_eq!(key("n1").security_groups, ["sg-a", "sg-b"]);
    assert_eq!(key("n1"), PoolKey::new("n1", "proj", "net", vec!["sg-a".into(), "sg-b".into()]));
    assert_ne!(key("n1"), key("n2"));
}

#[test]
fn refills_by_batches_below_min_and_never_beyond_max() {
    let mut inv = Inventory::default();
    let k = key("n1");
    assert_eq!(inv.refill(&k, LIMITS), 5, "an empty pool gets a batch");
    inv.creating(&k, 5);
    assert_eq!(inv.refill(&k, LIMITS), 0, "ports being created count");
    inv.created(&k, 5);
    for i in 0..2 {
        inv.put_free(&k, port(&format!("p{i}")));
    }
    assert_eq!(inv.refill(&k, LIMITS), 5, "2 < min 3");
    for i in 2..7 {
        inv.put_free(&k, port(&format!("p{i}")));
    }
    assert_eq!(inv.refill(&k, LIMITS), 0);
    // A batch bigger than the room under max is cut down to the room.
    let tight = Limits { min: 3, batch: 10, max: 4 };
    let mut inv2 = Inventory::default();
    inv2.put_free(&k, port("x"));
    assert_eq!(inv2.refill(&k, tight), 3);
    // A minimum above the batch is met in one go.
    assert_eq!(Inventory::default().refill(&k, Limits { min: 12, batch: 5, max: 0 }), 12);
    assert_eq!(Inventory::default().refill(&k, Limits { min: 3, batch: 0, max: 0 }), 0, "pools off");
    assert_eq!(inv.top_up(&k, 10, LIMITS), 1, "7 spare, max 8");
    assert_eq!(inv.top_up(&k, 4, LIMITS), 0);
    assert_eq!(inv.top_up(&k, 10, Limits { max: 0, ..LIMITS }), 3);
}

#[test]
fn ports_move_between_free_in_use_and_recycling() {
    let mut inv = Inventory::default();
    let k = key("n1");
    inv.put_free(&k, port("a"));
    inv.put_free(&k, port("b"));
    let p = inv.take(&k).unwrap();
    assert_eq!(p.id, "a", "oldest first");
    assert!(inv.assign("uid-1", &k, p).is_none());
    assert_eq!(inv.held("uid-1").unwrap().id, "a");
    // Assigning another port to the same pod returns the one it replaces (a duplicate).
    assert_eq!(inv.assign("uid-1", &k, port("z")).unwrap().id, "a");
    inv.assign("uid-1", &k, port("a"));
    assert_eq!(inv.view(&k).unwrap().in_use, 1);
    assert_eq!(inv.total(), 2);

    let (kk, released) = inv.unassign("uid-1").unwrap();
    assert_eq!(kk, k);
    assert!(inv.keeps(&k, LIMITS));
    let t0 = Instant::now();
    inv.put_recycling(&k, released, t0);
    let v = inv.view(&k).unwrap();
    assert_eq!((v.free.as_slice(), v.recycling, v.in_use), (["b".to_string()].as_slice(), 1, 0));
    assert_eq!(inv.recycling(), [(k.clone(), "a".to_string(), t0)]);
    assert!(inv.recycled(&k, "a"));
    assert!(!inv.recycled(&k, "a"), "only once");
    assert_eq!(inv.view(&k).unwrap().free, ["b", "a"]);

    let p = inv.take(&k).unwrap();
    inv.untake(&k, p);
    assert_eq!(inv.view(&k).unwrap().free, ["b", "a"], "a failed hand-out goes back to the head");
    assert_eq!(inv.drain_free(|kk| kk.node == "n2"), []);
    let drained: Vec<String> = inv.drain_free(|_| true).into_iter().map(|(_, p)| p.id).collect();
    assert_eq!(drained, ["b", "a"]);
    assert_eq!(inv.total(), 0);
    inv.put_free(&key("n2"), port("c"));
    inv.forget_pools(|_| true);
    let left: Vec<String> = inv.views().into_iter().map(|v| v.key.node).collect();
    assert_eq!(left, ["n2"], "only empty pools are forgotten");
}

#[test]
fn a_shard_change_forgets_or_replaces_only_its_nodes_pools() {
    let mut inv = Inventory::default();
    let (k1, k2) = (key("n1"), key("n2"));
    inv.put_free(&k1, port("f1"));
    inv.put_recycling(&k1, port("r1"), Instant::now());
    inv.assign("uid-1", &k1, port("u1"));
    inv.put_free(&k2, port("f2"));
    inv.assign("uid-2", &k2, port("u2"));
    inv.creating(&key("n3"), 3);
    let mut gone = inv.forget_nodes(|n| n == "n1" || n == "n3");
    gone.sort();
    assert_eq!(gone, ["f1", "r1", "u1"]);
    assert!(inv.held("uid-1").is_none() && inv.held("uid-2").is_some());
    assert_eq!(inv.nodes().into_iter().collect::<Vec<_>>(), ["n2", "n3"], "a pool being filled stays counted");
    assert_eq!(inv.refill(&key("n3"), LIMITS), 0, "its creations still count");

    // Gained again: what Neutron has now replaces what was known; other nodes stay as they are.
    inv.put_free(&k1, port("stale"));
    let mut fresh = Inventory::default();
    fresh.put_free(&k1, port("f1"));
    fresh.assign("uid-9", &k1, port("u9"));
    fresh.put_free(&k2, port("not-mine"));
    inv.replace_nodes(|n| n == "n1", fresh);
    assert_eq!(inv.view(&k1).unwrap().free, ["f1"]);
    assert_eq!(inv.held("uid-9").unwrap().id, "u9");
    assert_eq!(inv.view(&k2).unwrap().free, ["f2"], "a node outside the selection keeps its pool");
    assert_eq!(inv.total(), 4);
}

#[test]
fn ports_unknown_here_are_absorbed_except_into_pools_being_filled() {
    let mut inv = Inventory::default();
    let (k1, k2) = (key("n1"), key("n2"));
    inv.put_free(&k1, port("a"));
    inv.assign("uid-1", &k1, port("b"));
    inv.creating(&k2, 1);
    let mut fresh = Inventory::default();
    fresh.put_free(&k1, port("a"));
    fresh.put_free(&k1, port("b"));
    fresh.put_free(&k1, port("c"));
    fresh.put_recycling(&k1, port("d"), Instant::now());
    fresh.assign("uid-2", &k1, port("e"));
    fresh.assign("uid-1", &k1, port("f"));
    fresh.put_free(&k2, port("g"));
    fresh.put_free(&key("n3"), port("h"));
    let listed_after = inv.removals();
    assert_eq!(inv.absorb_unknown(|n| n != "n3", fresh, listed_after), 3, "c, d and e");
    assert_eq!(inv.view(&k1).unwrap().free, ["a", "c"]);
    assert_eq!(inv.view(&k1).unwrap().recycling, 1);
    assert_eq!(inv.held("uid-2").unwrap().id, "e");
    assert_eq!(inv.held("uid-1").unwrap().id, "b", "a pod keeps the port it holds here");
    assert!(inv.view(&k2).unwrap().free.is_empty(), "a pool being filled takes its ports as they come");
    assert!(inv.view(&key("n3")).is_none());
}

#[test]
fn ports_removed_while_neutron_was_listed_are_not_absorbed_back() {
    let mut inv = Inventory::default();
    let k = key("n1");
    inv.put_free(&k, port("a"));
    inv.put_free(&k, port("b"));
    inv.assign("uid-1", &k, port("c"));
    let listed_after = inv.removals();
    // The listing, begun now, still names every port.
    let listing = || {
        let mut fresh = Inventory::default();
        for id in ["a", "b", "x"] {
            fresh.put_free(&k, port(id));
        }
        fresh.assign("uid-1", &k, port("c"));
        fresh
    };
    // Meanwhile: the pool is drained for deletion and the pod's port released.
    assert_eq!(inv.drain_free(|_| true).len(), 2);
    assert!(inv.unassign("uid-1").is_some());
    assert_eq!(inv.absorb_unknown(|_| true, listing(), listed_after), 1, "only x, made elsewhere");
    assert_eq!(inv.view(&k).unwrap().free, ["x"]);
    assert!(inv.held("uid-1").is_none(), "the released port is not held again");
    // A port being deleted when the listing began, deleted before the absorb, is not taken
    // back either; nor one whose deletion is still in flight.
    let mut del = Inventory::default();
    let at = del.removals();
    del.changing("a");
    del.changing("b");
    del.changed("a");
    assert_eq!(del.absorb_unknown(|_| true, listing(), at), 2, "x and c");
    assert!(del.view(&k).unwrap().free == ["x"]);
    // A listing begun after the removals takes what Neutron still has.
    let mut again = Inventory::default();
    let now = again.removals();
    assert_eq!(again.absorb_unknown(|_| true, listing(), now), 4);
    // More removals than are remembered: nothing is absorbed from the older listing.
    let mut busy = Inventory::default();
    let before = busy.removals();
    for i in 0..=REMOVALS_KEPT {
        busy.put_free(&k, port(&format!("p{i}")));
        assert!(busy.take(&k).is_some());
    }
    assert_eq!(busy.absorb_unknown(|_| true, listing(), before), 0);
    assert_eq!(busy.absorb_unknown(|_| true, listing(), busy.removals()), 4);
}

#[test]
fn a_port_being_handed_out_or_released_is_not_absorbed_from_a_listing_that_saw_it_before() {
    let mut inv = Inventory::default();
    let k = key("n1");
    inv.put_free(&k, port("a"));
    inv.assign("uid-1", &k, port("b"));
    // Taken for a pod; the listing begins after the take and answers before Neutron has the
    // pod's device id on it, so it names the port free.
    assert_eq!(inv.take(&k).unwrap().id, "a");
    let during = inv.removals();
    let free_a = || {
        let mut fresh = Inventory::default();
        fresh.put_free(&k, port("a"));
        fresh
    };
    assert_eq!(inv.absorb_unknown(|_| true, free_a(), during), 0, "a is being handed out");
    // The hand-out ends; the listing begun while it was in flight still does not bring it back.
    inv.changed("a");
    assert_eq!(inv.absorb_unknown(|_| true, free_a(), during), 0);
    assert!(inv.view(&k).unwrap().free.is_empty());
    inv.assign("uid-2", &k, port("a"));
    // Released: the listing begun after the unassign may still show the pod's device id on it.
    let (_, b) = inv.unassign("uid-1").unwrap();
    inv.changing(&b.id);
    let during = inv.removals();
    let held_b = || {
        let mut fresh = Inventory::default();
        fresh.assign("uid-1", &k, port("b"));
        fresh
    };
    assert_eq!(inv.absorb_unknown(|_| true, held_b(), during), 0, "b is being released");
    inv.changed(&b.id);
    assert_eq!(inv.absorb_unknown(|_| true, held_b(), during), 0);
    assert!(inv.held("uid-1").is_none());
    // A listing begun after the change ended takes what Neutron says.
    let after = inv.removals();
    assert_eq!(inv.absorb_unknown(|_| true, held_b(), after), 1);
}

/// Which pools a replica keeps follows the shard of their node, as kuryr_shard assigns it.
#[test]
fn pools_follow_the_shard_of_their_node() {
    let mut inv = Inventory::default();
    let nodes: Vec<String> = (0..16).map(|i| format!("node-{i}")).collect();
    for (i, n) in nodes.iter().enumerate() {
        inv.put_free(&key(n), port(&format!("p{i}")));
    }
    let mine: std::collections::BTreeSet<u32> = [0, 2].into();
    let owns = |n: &str| kuryr_shard::shard_of(n, 4).is_some_and(|s| mine.contains(&s));
    inv.forget_nodes(|n| !owns(n));
    let kept = inv.nodes();
    assert!(!kept.is_empty() && kept.len() < nodes.len(), "{kept:?}");
    for n in &nodes {
        assert_eq!(kept.contains(n), owns(n), "{n}");
    }
}

#[test]
fn released_ports_are_kept_only_under_max() {
    let mut inv = Inventory::default();
    let k = key("n1");
    let small = Limits { min: 1, batch: 1, max: 2 };
    assert!(inv.keeps(&k, small));
    inv.put_free(&k, port("a"));
    inv.put_recycling(&k, port("b"), Instant::now());
    assert!(!inv.keeps(&k, small), "free + recycling = max");
    assert!(inv.keeps(&k, Limits { max: 0, ..small }), "no cap");
    assert!(!Inventory::default().keeps(&k, Limits { min: 0, batch: 0, max: 0 }), "pools off: delete");
    assert_eq!(inv.drop_recycling(&k, "b").unwrap().id, "b");
    assert!(inv.keeps(&k, small));
}

#[test]
fn ports_in_flight_are_counted_per_selected_pools() {
    let mut inv = Inventory::default();
    inv.creating(&key("n1"), 2);
    inv.creating(&key("n2"), 3);
    assert_eq!(inv.creating_for(|k| k.node == "n1"), 2);
    assert_eq!(inv.creating_for(|_| true), 5);
    inv.created(&key("n1"), 2);
    assert_eq!(inv.creating_for(|k| k.node == "n1"), 0);
    assert_eq!(inv.creating_for(|k| k.node == "n3"), 0);
}

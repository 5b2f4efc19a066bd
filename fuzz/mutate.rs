//! Mutations of seed inputs for the fuzz tests (property tests with proptest) of the shim and
//! the binder, which include this file. A case is a seed from `fuzz/corpus/` and a short list of
//! mutations: byte-level (flips, insertions, deletions, truncation, duplication, splices from
//! other seeds) and structure-aware (a JSON value anywhere in the document replaced by one of any
//! type, including huge numbers, deep nesting and control characters). proptest shrinks a failing
//! case to the fewest, smallest mutations.

#![allow(dead_code)]

use std::path::PathBuf;

use proptest::prelude::*;
use serde_json::Value;

/// One change to an input.
#[derive(Clone, Debug)]
pub enum Mutation {
    Flip {
        at: usize,
        bit: u8,
    },
    Insert {
        at: usize,
        bytes: Vec<u8>,
    },
    Delete {
        at: usize,
        len: usize,
    },
    Truncate {
        at: usize,
    },
    Duplicate {
        at: usize,
        len: usize,
    },
    Splice {
        at: usize,
        other: usize,
        from: usize,
        len: usize,
    },
    /// Replace the `node`-th value of the JSON document (in walk order) by `value`.
    JsonValue {
        node: usize,
        value: Value,
    },
    /// Remove the `node`-th object member.
    JsonRemove {
        node: usize,
    },
}

/// Every seed in `fuzz/corpus/<dir>`, sorted by file name; fails when there is none.
pub fn corpus(dir: &str) -> Vec<Vec<u8>> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .find(|p| p.join("fuzz/corpus").is_dir())
        .map(|p| p.join("fuzz/corpus").join(dir));
    let root = root.unwrap_or_else(|| panic!("fuzz/corpus not found above {}", env!("CARGO_MANIFEST_DIR")));
    let mut files: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap_or_else(|e| panic!("{}: {e}", root.display()))
        .map(|e| e.unwrap_or_else(|e| panic!("{}: {e}", root.display())).path())
        .collect();
    files.sort();
    let seeds: Vec<Vec<u8>> =
        files.iter().map(|f| std::fs::read(f).unwrap_or_else(|e| panic!("{}: {e}", f.display()))).collect();
    assert!(!seeds.is_empty(), "{}: no seeds", root.display());
    seeds
}

/// Values that have broken parsers before, or might.
fn special_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        Just(Value::from(u64::MAX)),
        Just(Value::from(i64::MIN)),
        Just(Value::from(360_000_000_000u64)),
        Just(serde_json::json!(1e300)),
        Just(serde_json::json!(-0.0)),
        Just(Value::from("")),
        Just(Value::from("1.1.0")),
        Just(Value::from("0.2.0")),
        Just(Value::from("/proc/self/ns/net")),
        Just(Value::from("../../../../etc/passwd")),
        Just(Value::from("\u{0}\u{7f}\u{202e}")),
        Just(Value::from("x".repeat(70_000))),
        Just(Value::from("10.0.0.1/33")),
        Just(Value::from("fd00::1/129")),
        Just(Value::from("zz:zz:zz:zz:zz:zz")),
        Just(nest(64)),
    ]
}

fn nest(depth: usize) -> Value {
    (0..depth).fold(Value::Null, |v, i| if i % 2 == 0 { Value::Array(vec![v]) } else { serde_json::json!({ "k": v }) })
}

/// Any JSON value, small.
pub fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>().prop_filter("finite", |f| f.is_finite()).prop_map(Value::from),
        ".{0,24}".prop_map(Value::from),
        special_value(),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::btree_map("[a-zA-Z./-]{0,12}", inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

pub fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), 0u8..8).prop_map(|(at, bit)| Mutation::Flip { at, bit }),
        (any::<usize>(), prop::collection::vec(any::<u8>(), 1..16))
            .prop_map(|(at, bytes)| Mutation::Insert { at, bytes }),
        (any::<usize>(), 1usize..32).prop_map(|(at, len)| Mutation::Delete { at, len }),
        any::<usize>().prop_map(|at| Mutation::Truncate { at }),
        (any::<usize>(), 1usize..64).prop_map(|(at, len)| Mutation::Duplicate { at, len }),
        (any::<usize>(), any::<usize>(), any::<usize>(), 1usize..64)
            .prop_map(|(at, other, from, len)| Mutation::Splice { at, other, from, len }),
        (any::<usize>(), json_value()).prop_map(|(node, value)| Mutation::JsonValue { node, value }),
        any::<usize>().prop_map(|node| Mutation::JsonRemove { node }),
    ]
}

/// A seed index and up to `max` mutations.
pub fn case(max: usize) -> impl Strategy<Value = (usize, Vec<Mutation>)> {
    (any::<usize>(), prop::collection::vec(mutation(), 0..=max))
}

/// `seeds[seed % len]` with `mutations` applied in order.
pub fn apply(seeds: &[Vec<u8>], seed: usize, mutations: &[Mutation]) -> Vec<u8> {
    let mut b = seeds[seed % seeds.len()].clone();
    for m in mutations {
        let at = |i: usize, b: &Vec<u8>| if b.is_empty() { 0 } else { i % (b.len() + 1) };
        match m {
            Mutation::Flip { at: i, bit } => {
                if !b.is_empty() {
                    let i = i % b.len();
                    b[i] ^= 1 << bit;
                }
            }
            Mutation::Insert { at: i, bytes } => {
                let i = at(*i, &b);
                b.splice(i..i, bytes.iter().copied());
            }
            Mutation::Delete { at: i, len } => {
                let i = at(*i, &b);
                let end = (i + len).min(b.len());
                b.drain(i..end);
            }
            Mutation::Truncate { at: i } => {
                let i = at(*i, &b);
                b.truncate(i);
            }
            Mutation::Duplicate { at: i, len } => {
                let i = at(*i, &b);
                let end = (i + len).min(b.len());
                let piece: Vec<u8> = b[i..end].to_vec();
                b.splice(end..end, piece);
            }
            Mutation::Splice { at: i, other, from, len } => {
                let o = &seeds[other % seeds.len()];
                let from = if o.is_empty() { 0 } else { from % o.len() };
                let piece: Vec<u8> = o[from..(from + len).min(o.len())].to_vec();
                let i = at(*i, &b);
                b.splice(i..i, piece);
            }
            Mutation::JsonValue { node, value } => {
                if let Ok(mut doc) = serde_json::from_slice::<Value>(&b) {
                    let count = count_nodes(&doc);
                    replace_nth(&mut doc, node % count, value, &mut 0);
                    b = serde_json::to_vec(&doc).unwrap_or_default();
                }
            }
            Mutation::JsonRemove { node } => {
                if let Ok(mut doc) = serde_json::from_slice::<Value>(&b) {
                    let members = count_members(&doc);
                    if members > 0 {
                        remove_nth(&mut doc, node % members, &mut 0);
                        b = serde_json::to_vec(&doc).unwrap_or_default();
                    }
                }
            }
        }
    }
    b
}

fn count_nodes(v: &Value) -> usize {
    1 + match v {
        Value::Array(a) => a.iter().map(count_nodes).sum(),
        Value::Object(o) => o.values().map(count_nodes).sum(),
        _ => 0,
    }
}

fn replace_nth(v: &mut Value, n: usize, with: &Value, seen: &mut usize) -> bool {
    if *seen == n {
        *v = with.clone();
        return true;
    }
    *seen += 1;
    match v {
        Value::Array(a) => a.iter_mut().any(|c| replace_nth(c, n, with, seen)),
        Value::Object(o) => o.values_mut().any(|c| replace_nth(c, n, with, seen)),
        _ => false,
    }
}

fn count_members(v: &Value) -> usize {
    match v {
        Value::Array(a) => a.iter().map(count_members).sum(),
        Value::Object(o) => o.len() + o.values().map(count_members).sum::<usize>(),
        _ => 0,
    }
}

fn remove_nth(v: &mut Value, n: usize, seen: &mut usize) -> bool {
    match v {
        Value::Array(a) => a.iter_mut().any(|c| remove_nth(c, n, seen)),
        Value::Object(o) => {
            let keys: Vec<String> = o.keys().cloned().collect();
            for k in keys {
                if *seen == n {
                    o.remove(&k);
                    return true;
                }
                *seen += 1;
                if o.get_mut(&k).is_some_and(|c| remove_nth(c, n, seen)) {
                    return true;
                }
            }
            false
        }
        _ => false,
    }
}

/// The `KEY=VALUE` lines of an env seed.
pub fn env_pairs(seed: &[u8]) -> Vec<(String, Vec<u8>)> {
    seed.split(|b| *b == b'\n')
        .filter(|l| !l.is_empty())
        .filter_map(|l| {
            let i = l.iter().position(|b| *b == b'=')?;
            Some((String::from_utf8_lossy(&l[..i]).into_owned(), l[i + 1..].to_vec()))
        })
        .collect()
}

//! Fuzzing the shim's inputs, as the runtime hands them over: the `CNI_*` environment and the
//! configuration on stdin (its `prevResult` included), from the seeds in `fuzz/corpus/` mutated
//! by `fuzz/mutate.rs`. Whatever comes in, the shim must not panic, must print exactly one JSON
//! document, and every failure must be the spec's error object (`cniVersion`, `code`, `msg`) with
//! exit status 1; only VERSION succeeds, the binder being out of reach.
//!
//! Property tests with proptest rather than cargo-fuzz: they run under `cargo test` on the
//! stable toolchain, so CI runs them with every build (briefly: `PROPTEST_CASES` sets how many
//! cases, 2,000 per property by default). A failing case is shrunk and printed; add it to the
//! corpus.
#![allow(clippy::unwrap_used)]

#[path = "../../fuzz/mutate.rs"]
mod mutate;

use std::collections::HashMap;
use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;

use kuryr_cni::{Stdin, run};
use kuryr_cni_types::{CniResult, CniVersion, NetConf, SUPPORTED_VERSIONS};
use mutate::{apply, case, corpus, env_pairs, json_value};
use proptest::prelude::*;
use proptest::test_runner::Config;
use serde_json::Value;

/// Where the shim is pointed: nothing listens there, so no case ever reaches a binder (a binder
/// running on this machine must not receive fuzzed ADDs and DELs).
const DEAD_SOCKET: &str = "/nonexistent/kuryr-fuzz/binder.sock";

fn config() -> Config {
    Config { cases: 2000, failure_persistence: None, ..Config::default() }
}

/// A configuration that parses as an object gets the dead socket and logs to /dev/null (a
/// fuzzed `logFile` could name any file on the machine); anything else is left as it is.
fn defang(bytes: Vec<u8>) -> Vec<u8> {
    match serde_json::from_slice::<Value>(&bytes) {
        Ok(Value::Object(mut o)) => {
            o.insert("binderSocket".into(), Value::from(DEAD_SOCKET));
            o.insert("logFile".into(), Value::from("/dev/null"));
            serde_json::to_vec(&Value::Object(o)).unwrap()
        }
        _ => bytes,
    }
}

/// One environment edit: a variable set (to a seed's value or random bytes) or removed.
fn env_edit() -> impl Strategy<Value = (String, Option<Vec<u8>>)> {
    let key = prop_oneof![
        Just("CNI_COMMAND".to_string()),
        Just("CNI_CONTAINERID".to_string()),
        Just("CNI_NETNS".to_string()),
        Just("CNI_IFNAME".to_string()),
        Just("CNI_ARGS".to_string()),
        Just("CNI_PATH".to_string()),
    ];
    let value = prop_oneof![
        prop::collection::vec(any::<u8>(), 0..40).prop_map(Some),
        "[A-Za-z0-9=;/._-]{0,40}".prop_map(|s| Some(s.into_bytes())),
        prop_oneof![Just("ADD"), Just("DEL"), Just("CHECK"), Just("GC"), Just("STATUS"), Just("VERSION")]
            .prop_map(|s| Some(s.as_bytes().to_vec())),
        Just(None),
    ];
    (key, value)
}

/// Runs the shim and checks the outcome; `what` describes the case.
fn check(env: &HashMap<String, OsString>, stdin: Vec<u8>, what: &str) -> Result<(), TestCaseError> {
    let lookup = |k: &str| env.get(k).cloned();
    let out = run(&lookup, &Stdin::Read(stdin));
    let doc = out.stdout.as_deref().ok_or_else(|| TestCaseError::fail(format!("{what}: nothing on stdout")))?;
    let v: Value =
        serde_json::from_str(doc).map_err(|e| TestCaseError::fail(format!("{what}: not JSON: {e}: {doc}")))?;
    let command = env.get("CNI_COMMAND").and_then(|c| c.to_str());
    if out.exit_code == 0 {
        prop_assert_eq!(command, Some("VERSION"), "{}: only VERSION succeeds without a binder: {}", what, doc);
        prop_assert!(v["supportedVersions"].is_array(), "{}: {}", what, doc);
    } else {
        prop_assert_eq!(out.exit_code, 1, "{}", what);
        prop_assert!(v["code"].is_u64() && v["code"].as_u64() != Some(0), "{}: no error code: {}", what, doc);
        prop_assert!(v["msg"].as_str().is_some_and(|m| !m.is_empty()), "{}: no message: {}", what, doc);
        let version = v["cniVersion"].as_str().unwrap_or_default();
        prop_assert!(SUPPORTED_VERSIONS.contains(&version), "{}: cniVersion {:?}: {}", what, version, doc);
    }
    Ok(())
}

#[test]
fn any_config_and_environment_is_answered_with_one_json_document() {
    let configs = corpus("config");
    let envs = corpus("env");
    let strategy = (case(6), any::<usize>(), prop::collection::vec(env_edit(), 0..4));
    proptest!(config(), |((config, env_seed, edits) in strategy)| {
        let (seed, mutations) = config;
        let stdin = defang(apply(&configs, seed, &mutations));
        let mut env: HashMap<String, OsString> = env_pairs(&envs[env_seed % envs.len()])
            .into_iter()
            .map(|(k, v)| (k, OsString::from_vec(v)))
            .collect();
        for (k, v) in edits {
            match v {
                Some(v) => env.insert(k, OsString::from_vec(v)),
                None => env.remove(&k),
            };
        }
        check(&env, stdin, &format!("config seed {seed} {mutations:?}, env {env:?}"))?;
    });
}

#[test]
fn the_seeds_themselves_are_answered() {
    for config in corpus("config") {
        for env in corpus("env") {
            let env: HashMap<String, OsString> =
                env_pairs(&env).into_iter().map(|(k, v)| (k, OsString::from_vec(v))).collect();
            check(&env, defang(config.clone()), &String::from_utf8_lossy(&config)).unwrap();
        }
    }
}

#[test]
fn any_prev_result_is_read_or_refused_with_code_7() {
    let configs = corpus("config");
    proptest!(config(), |(seed in any::<usize>(), prev in json_value())| {
        let mut conf: Value = serde_json::from_slice(&configs[seed % configs.len()]).unwrap();
        if !conf.is_object() || !conf["cniVersion"].is_string() || !conf["name"].is_string() || !conf["type"].is_string() {
            return Ok(());
        }
        conf["prevResult"] = prev.clone();
        match NetConf::parse(&serde_json::to_vec(&conf).unwrap()) {
            Ok(c) => {
                // What was read renders in every version and reads back.
                if let Some(r) = c.prev_result {
                    for v in [CniVersion::V0_3_0, CniVersion::V0_3_1, CniVersion::V0_4_0, CniVersion::V1_0_0, CniVersion::V1_1_0] {
                        let rendered = r.render(v);
                        prop_assert!(CniResult::from_value(&rendered).is_ok(), "{:?} rendered as {} does not read back", prev, rendered);
                    }
                }
            }
            Err(e) => prop_assert!(e.code == 1 || e.code == 7, "prevResult {:?}: code {}: {}", prev, e.code, e.msg),
        }
    });
}

#[test]
fn any_cni_args_are_read_or_refused_with_code_4() {
    let seeds: Vec<Vec<u8>> = corpus("cni-args")
        .iter()
        .flat_map(|f| f.split(|b| *b == b'\n').map(<[u8]>::to_vec).collect::<Vec<_>>())
        .collect();
    proptest!(config(), |(c in case(6))| {
        let (seed, mutations) = c;
        let raw = apply(&seeds, seed, &mutations);
        if let Ok(s) = std::str::from_utf8(&raw)
            && let Err(e) = kuryr_cni_types::CniArgs::parse(s)
        {
            prop_assert_eq!(e.code, 4, "{:?}: {}", s, e.msg);
        }
    });
}

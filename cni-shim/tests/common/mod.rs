//! Runs the built `kuryr-cni` binary as a runtime would: a cleared environment, stdin, stdout.

#![allow(dead_code)]

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// What one execution of the shim produced.
#[derive(Debug)]
pub struct Run {
    pub status: i32,
    pub stdout: String,
    pub stderr: String,
    pub took: Duration,
}

impl Run {
    /// The single JSON document on stdout. Fails unless stdout holds exactly one line of JSON.
    pub fn json(&self) -> Value {
        assert!(self.stdout.ends_with('\n'), "stdout does not end with a newline: {self:?}");
        assert_eq!(self.stdout.lines().count(), 1, "stdout holds more than one line: {self:?}");
        serde_json::from_str(&self.stdout).unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {self:?}"))
    }

    /// Asserts a CNI error object with `code` whose `msg` contains `msg`, and exit status 1.
    pub fn assert_error(&self, code: u64, msg: &str) -> Value {
        let v = self.json();
        assert_eq!(self.status, 1, "{self:?}");
        assert_eq!(v["code"].as_u64(), Some(code), "{self:?}");
        let got = v["msg"].as_str().unwrap_or_else(|| panic!("no msg: {self:?}"));
        assert!(got.contains(msg), "msg {got:?} does not contain {msg:?}: {self:?}");
        let keys: Vec<&String> = v.as_object().expect("an object").keys().collect();
        for k in &keys {
            assert!(["cniVersion", "code", "msg", "details"].contains(&k.as_str()), "unexpected key {k}: {self:?}");
        }
        v
    }
}

/// Executes the shim with exactly `env` and `stdin`.
pub fn shim(env: &[(&str, &str)], stdin: &[u8]) -> Run {
    let started = Instant::now();
    let mut child = Command::new(env!("CARGO_BIN_EXE_kuryr-cni"))
        .env_clear()
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn kuryr-cni");
    let mut pipe = child.stdin.take().expect("stdin");
    let input = stdin.to_vec();
    let writer = std::thread::spawn(move || {
        // The shim may stop reading early only by exiting; a broken pipe then is its answer.
        let _ = pipe.write_all(&input);
    });
    let out = child.wait_with_output().expect("wait for kuryr-cni");
    let took = started.elapsed();
    writer.join().expect("stdin writer");
    Run {
        status: out.status.code().expect("exited, not killed"),
        stdout: String::from_utf8(out.stdout).expect("stdout is UTF-8"),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        took,
    }
}

/// The environment of an operation on container `abc123`, interface `eth0`.
pub fn env_for(command: &'static str) -> Vec<(&'static str, &'static str)> {
    vec![
        ("CNI_COMMAND", command),
        ("CNI_CONTAINERID", "abc123"),
        ("CNI_NETNS", "/var/run/netns/cni-test"),
        ("CNI_IFNAME", "eth0"),
        ("CNI_ARGS", "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web-0;K8S_POD_UID=u-1"),
        ("CNI_PATH", "/opt/cni/bin"),
    ]
}

/// A configuration for `version` pointing at `socket`.
pub fn config(version: &str, socket: &std::path::Path, timeout: u64) -> String {
    serde_json::json!({
        "cniVersion": version,
        "name": "kuryr",
        "type": "kuryr-cni",
        "binderSocket": socket,
        "timeoutSeconds": timeout,
    })
    .to_string()
}

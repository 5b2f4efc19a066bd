//! `kuryr-cni`: the CNI plugin binary the container runtime executes for every pod operation.
//!
//! It owns nothing: it checks the `CNI_*` environment and the configuration on stdin, forwards
//! ADD, DEL, CHECK, STATUS and GC to kuryr-binder over the binder's unix socket (`binderSocket`),
//! and prints the binder's answer. VERSION is answered here, without the binder.
//!
//! The contract with the runtime (CNI 1.1):
//! - stdout carries exactly one JSON document or nothing: the ADD result in the configuration's
//!   `cniVersion`, the VERSION answer, or an error object `{cniVersion, code, msg, details}` with
//!   exit status 1. Logs go to stderr, or to `logFile`.
//! - one attempt per invocation, bounded by `timeoutSeconds`; an unreachable binder fails at once
//!   with code 11 (50 for STATUS), and the runtime decides when to try again.
//!
//! The CNI data model, and why it is written here rather than taken from a CNI crate, is in
//! `kuryr-cni-types`. This crate keeps to a current-thread tokio runtime, one hyper HTTP/2
//! connection carrying tonic's generated client, and serde_json, so that the binary stays small
//! and starts in about a millisecond.

mod binder;
mod invocation;
mod log;

use std::time::{Duration, Instant};

use kuryr_cni_types::{CniError, CniVersion, Command, NetConf, requested_version, version_result};

pub use binder::{Hops, SHIM_VERSION};
pub use invocation::{EnvLookup, Invocation, Stdin};
pub use log::Log;

/// What to print on stdout, and the exit status.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outcome {
    /// One JSON document, or nothing.
    pub stdout: Option<String>,
    /// 0 on success, 1 on failure.
    pub exit_code: u8,
}

/// Runs one CNI invocation: `env` gives the `CNI_*` variables, `stdin` the configuration.
pub fn run(env: EnvLookup<'_>, stdin: &Stdin) -> Outcome {
    let started = Instant::now();
    let mut log = Log::stderr();
    let mut command = None;
    let mut hops = Hops::default();
    match execute(env, stdin, &mut log, &mut command, &mut hops) {
        Ok(stdout) => {
            if let Some(c) = command.filter(|c| *c != Command::Version) {
                // Where the shim's own time went, for whoever reads its log (the bench does).
                let total = started.elapsed();
                let ms = |d: Duration| d.as_secs_f64() * 1e3;
                let rest = total.saturating_sub(hops.runtime + hops.connect + hops.call);
                log.line(format_args!(
                    "{c} ok in {:.3} ms (runtime {:.3}, connect {:.3}, call {:.3}, rest {:.3})",
                    ms(total),
                    ms(hops.runtime),
                    ms(hops.connect),
                    ms(hops.call),
                    ms(rest)
                ));
            }
            Outcome { stdout, exit_code: 0 }
        }
        Err(e) => {
            // The error is printed in the requested version when it can be read at all.
            let version = stdin.bytes().ok().and_then(requested_version).unwrap_or(CniVersion::LATEST);
            let op = command.map_or("?", Command::as_str);
            let details = if e.details.is_empty() { String::new() } else { format!(" ({})", e.details) };
            log.line(format_args!("{op} failed in {}ms: {e}{details}", started.elapsed().as_millis()));
            Outcome { stdout: Some(e.to_json(version).to_string()), exit_code: 1 }
        }
    }
}

fn execute(
    env: EnvLookup<'_>,
    stdin: &Stdin,
    log: &mut Log,
    command: &mut Option<Command>,
    hops: &mut Hops,
) -> Result<Option<String>, CniError> {
    let cmd = Invocation::command(env)?;
    *command = Some(cmd);
    let config = stdin.bytes()?;
    if cmd == Command::Version {
        return version_result(config).map(|v| Some(v.to_string()));
    }
    let inv = Invocation::from_env(cmd, env)?;
    let conf = NetConf::parse(config)?;
    if let Some(f) = &conf.log_file {
        *log = Log::to_file(f.clone());
    }
    check_command_version(cmd, conf.cni_version)?;
    binder::call(&conf, &inv, config, log, hops)
}

/// CHECK exists from cniVersion 0.4.0, STATUS and GC from 1.1.0; a configuration of an older
/// version asking for them is refused with code 1, as libcni does.
fn check_command_version(cmd: Command, version: CniVersion) -> Result<(), CniError> {
    let needs = match cmd {
        Command::Check => CniVersion::V0_4_0,
        Command::Status | Command::Gc => CniVersion::V1_1_0,
        _ => return Ok(()),
    };
    if version < needs {
        return Err(CniError::incompatible_version(format!(
            "{} needs cniVersion {needs} or later; the configuration says {version}",
            cmd.as_str()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::ffi::OsString;
    use std::os::unix::ffi::OsStringExt;

    use serde_json::{Value, json};

    use super::*;

    fn run_with(pairs: &[(&str, &str)], stdin: &[u8]) -> (Value, u8) {
        let m: HashMap<String, OsString> = pairs.iter().map(|(k, v)| (k.to_string(), OsString::from(v))).collect();
        let env = move |k: &str| m.get(k).cloned();
        let out = run(&env, &Stdin::Read(stdin.to_vec()));
        (serde_json::from_str(&out.stdout.unwrap()).unwrap(), out.exit_code)
    }

    const ADD: &[(&str, &str)] = &[
        ("CNI_COMMAND", "ADD"),
        ("CNI_CONTAINERID", "abc"),
        ("CNI_NETNS", "/var/run/netns/x"),
        ("CNI_IFNAME", "eth0"),
        ("CNI_PATH", "/opt/cni/bin"),
    ];

    #[test]
    fn version_is_answered_locally() {
        let (v, code) = run_with(&[("CNI_COMMAND", "VERSION")], br#"{"cniVersion":"0.4.0"}"#);
        assert_eq!(code, 0);
        assert_eq!(
            v,
            json!({"cniVersion": "0.4.0", "supportedVersions": ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"]})
        );
    }

    #[test]
    fn errors_are_printed_in_the_requested_version() {
        let conf = br#"{"cniVersion":"0.3.1","name":"n","type":"kuryr-cni"}"#;
        let no_ifname: Vec<(&str, &str)> = ADD.iter().copied().filter(|(k, _)| *k != "CNI_IFNAME").collect();
        let (v, code) = run_with(&no_ifname, conf);
        assert_eq!(code, 1);
        assert_eq!(
            v,
            json!({"cniVersion": "0.3.1", "code": 4, "msg": "missing or empty environment variable: CNI_IFNAME"})
        );
        let (v, _) = run_with(&[("CNI_COMMAND", "ADD")], b"{");
        assert_eq!(v["cniVersion"], "1.1.0");
    }

    #[test]
    fn config_errors() {
        let table: &[(&[u8], u64, &str)] = &[
            (b"{", 6, "cannot decode"),
            (br#"{"cniVersion":"0.2.0","name":"n","type":"t"}"#, 1, "unsupported cniVersion \"0.2.0\""),
            (br#"{"cniVersion":"1.0.0","type":"t"}"#, 7, "\"name\""),
        ];
        for (stdin, want_code, want_msg) in table {
            let (v, code) = run_with(ADD, stdin);
            assert_eq!(code, 1);
            assert_eq!(v["code"], *want_code, "{v}");
            assert!(v["msg"].as_str().unwrap().contains(want_msg), "{v}");
        }
    }

    #[test]
    fn non_utf8_environment_is_code_4() {
        let env = |k: &str| (k == "CNI_COMMAND").then(|| OsString::from_vec(vec![0xff, b'A']));
        let out = run(&env, &Stdin::Read(Vec::new()));
        let v: Value = serde_json::from_str(&out.stdout.unwrap()).unwrap();
        assert_eq!((v["code"].as_u64(), v["msg"].as_str()), (Some(4), Some("CNI_COMMAND is not valid UTF-8")));
    }

    #[test]
    fn absent_binder_is_code_11() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("absent.sock");
        let conf = json!({"cniVersion": "1.0.0", "name": "n", "type": "kuryr-cni", "binderSocket": sock});
        let (v, code) = run_with(ADD, conf.to_string().as_bytes());
        assert_eq!(code, 1);
        assert_eq!(v["code"], 11);
        assert!(
            v["msg"].as_str().unwrap().starts_with(&format!("kuryr-binder is not reachable at {}", sock.display()))
        );
    }
}

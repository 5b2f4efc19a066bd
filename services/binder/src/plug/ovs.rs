//! `ovs-vsctl`, the same interface Kuryr and os-vif used, run as a child process with a deadline.

use std::process::Output;
use std::time::Duration;

use super::PlugError;

/// How long ovs-vsctl may wait for ovsdb-server and for ovs-vswitchd to apply a change
/// (`--timeout`). A healthy switch answers in milliseconds; a dead one must not hang a CNI ADD
/// past the runtime's own deadline (about 4 minutes), nor a rollback.
const VSCTL_TIMEOUT: Duration = Duration::from_secs(10);

/// Our own deadline on the child, a little beyond ovs-vsctl's, in case it ignores its own.
const CHILD_DEADLINE: Duration = Duration::from_secs(15);

/// The ovs-vsctl arguments that add `port` to `bridge` (if it is not there yet) and tag its
/// Interface row with the ids the Neutron agent / OVN controller look for.
pub(crate) fn add_port(bridge: &str, port: &str, iface_id: &str, attached_mac: &str, vm_uuid: &str) -> Vec<String> {
    let ext = |key: &str, value: &str| format!("external_ids:{key}={}", quote(value));
    vec![
        "--may-exist".into(),
        "add-port".into(),
        bridge.into(),
        port.into(),
        "--".into(),
        "set".into(),
        "Interface".into(),
        port.into(),
        ext("iface-id", iface_id),
        ext("attached-mac", attached_mac),
        ext("iface-status", "active"),
        ext("vm-uuid", vm_uuid),
    ]
}

/// The ovs-vsctl arguments that remove `port` from whichever bridge holds it, if any. No bridge
/// is named so that a bridge deleted in the meantime does not turn a cleanup into an error.
pub(crate) fn del_port(port: &str) -> Vec<String> {
    vec!["--if-exists".into(), "del-port".into(), port.into()]
}

/// An OVSDB string atom: JSON-quoted so that values with `:` or `=` (a MAC) stay one string.
fn quote(value: &str) -> String {
    serde_json::Value::from(value).to_string()
}

fn full_args(db: Option<&str>, args: &[String]) -> Vec<String> {
    let mut all = vec![format!("--timeout={}", VSCTL_TIMEOUT.as_secs())];
    all.extend(db.map(|db| format!("--db={db}")));
    all.extend(args.iter().cloned());
    all
}

fn check(args: &[String], out: Output) -> Result<String, PlugError> {
    if out.status.success() {
        return Ok(String::from_utf8_lossy(&out.stdout).into_owned());
    }
    Err(PlugError::Ovs {
        args: args.join(" "),
        detail: format!("{}: {}", out.status, String::from_utf8_lossy(&out.stderr).trim()),
    })
}

/// Runs ovs-vsctl (found on PATH) without blocking the executor; returns its stdout.
pub(crate) async fn vsctl(db: Option<&str>, args: &[String]) -> Result<String, PlugError> {
    let child = tokio::process::Command::new("ovs-vsctl").args(full_args(db, args)).kill_on_drop(true).output();
    let out = tokio::time::timeout(CHILD_DEADLINE, child)
        .await
        .map_err(|_| PlugError::Ovs { args: args.join(" "), detail: format!("no answer within {CHILD_DEADLINE:?}") })?
        .map_err(|source| PlugError::OvsSpawn { args: args.join(" "), source })?;
    check(args, out)
}

/// Runs ovs-vsctl and waits for it, blocking the calling thread: only for the rollback guard,
/// which runs on the plugging thread. ovs-vsctl's own `--timeout` bounds the wait.
pub(crate) fn vsctl_blocking(db: Option<&str>, args: &[String]) -> Result<String, PlugError> {
    let out = std::process::Command::new("ovs-vsctl")
        .args(full_args(db, args))
        .output()
        .map_err(|source| PlugError::OvsSpawn { args: args.join(" "), source })?;
    check(args, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn add_port_quotes_external_ids() {
        let args = add_port("br-int", "kv1", "port-1", "fa:16:3e:00:00:01", "uid-1");
        assert_eq!(
            args.join(" "),
            "--may-exist add-port br-int kv1 -- set Interface kv1 external_ids:iface-id=\"port-1\" \
             external_ids:attached-mac=\"fa:16:3e:00:00:01\" external_ids:iface-status=\"active\" \
             external_ids:vm-uuid=\"uid-1\""
        );
        assert_eq!(quote("a\"b"), r#""a\"b""#);
    }

    #[test]
    fn db_and_timeout_come_first() {
        let args = full_args(Some("unix:/tmp/db.sock"), &del_port("kv1"));
        assert_eq!(args, ["--timeout=10", "--db=unix:/tmp/db.sock", "--if-exists", "del-port", "kv1"]);
        assert_eq!(full_args(None, &[]), ["--timeout=10"]);
    }
}

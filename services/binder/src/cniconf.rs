//! The CNI network configuration the container runtime reads, written by the binder itself once it
//! can serve ADDs: a runtime finds `kuryr-cni` configured only on nodes whose binder is up, so a
//! node does not report its network ready before pods could get one.
//!
//! The file is written atomically (a temporary file in the same directory, then a rename), once
//! per binder process, the first time the VIF stream is live. It is left in place at shutdown: while
//! the binder restarts, `kuryr-cni` fails fast with CNI code 11 (try again) and the runtime
//! retries, which is better than flapping the node's network readiness on every upgrade.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use kuryr_runtime::Shutdown;

use crate::vifs::VifCache;

/// The network name in the written configuration.
pub const NETWORK_NAME: &str = "kuryr";

/// The conflist's default `cniVersion`: 1.0.0, the newest that containerd 1.6/1.7 and CRI-O's
/// libcni accept (they refuse 1.1.0 results); 1.1.0 where the runtime's libcni is 1.2 or newer
/// enables STATUS and GC.
pub const DEFAULT_VERSION: &str = "1.0.0";

/// The conflist pointing the runtime at `kuryr-cni` with the binder's socket, in CNI `version`.
pub fn render(socket: &Path, version: &str) -> String {
    let conf = serde_json::json!({
        "cniVersion": version,
        "name": NETWORK_NAME,
        "plugins": [{
            "type": "kuryr-cni",
            "binderSocket": socket,
            // The runtime passes pods' host ports in runtimeConfig.portMappings only to plugins
            // that declare the capability; the binder programs them (no portmap plugin).
            "capabilities": {"portMappings": true},
        }],
    });
    let mut s = serde_json::to_string_pretty(&conf).unwrap_or_default();
    s.push('\n');
    s
}

/// Writes `contents` to `path` atomically, mode 0644 (runtimes read it as another user at times).
pub fn write_atomic(path: &Path, contents: &str) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    // A name the runtime ignores (it only loads *.conf, *.conflist and *.json).
    let tmp: PathBuf = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(contents.as_bytes())?;
        f.set_permissions(std::fs::Permissions::from_mode(0o644))?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Waits until `vifs` is live for the first time, then writes the conflist to `path`. A failed
/// write is retried with backoff (and logged): a node without it never gets pods.
pub async fn write_when_live(vifs: VifCache, path: PathBuf, socket: PathBuf, version: String, shutdown: Shutdown) {
    while !vifs.is_live() {
        tokio::select! {
            () = tokio::time::sleep(Duration::from_millis(100)) => {}
            () = shutdown.clone().wait() => return,
        }
    }
    let contents = render(&socket, &version);
    let mut backoff = kuryr_stream::Backoff::new("binder-cniconf", Duration::from_millis(200), Duration::from_secs(10));
    loop {
        match write_atomic(&path, &contents) {
            Ok(()) => {
                tracing::info!(path = %path.display(), socket = %socket.display(), "CNI configuration written");
                return;
            }
            Err(e) => {
                tracing::error!(path = %path.display(), error = %e, "cannot write the CNI configuration; retrying");
            }
        }
        tokio::select! {
            () = backoff.sleep("write") => {}
            () = shutdown.clone().wait() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_a_conflist_for_the_socket() {
        let s = render(Path::new("/run/kuryr/binder.sock"), DEFAULT_VERSION);
        let v: serde_json::Value = serde_json::from_str(&s).unwrap();
        assert_eq!(v["cniVersion"], "1.0.0");
        let s = render(Path::new("/run/kuryr/binder.sock"), "1.1.0");
        assert_eq!(serde_json::from_str::<serde_json::Value>(&s).unwrap()["cniVersion"], "1.1.0");
        assert_eq!(v["name"], NETWORK_NAME);
        assert_eq!(v["plugins"][0]["type"], "kuryr-cni");
        assert_eq!(v["plugins"][0]["binderSocket"], "/run/kuryr/binder.sock");
        assert_eq!(v["plugins"][0]["capabilities"]["portMappings"], true);
        assert_eq!(v["plugins"].as_array().map(Vec::len), Some(1), "no portmap plugin chained");
    }

    #[test]
    fn writes_atomically_and_replaces() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("net.d").join("10-kuryr.conflist");
        write_atomic(&path, "one").unwrap();
        write_atomic(&path, "two").unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "two");
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o644);
        let names: Vec<_> =
            std::fs::read_dir(path.parent().unwrap()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names.len(), 1, "leftovers: {names:?}");
    }
}

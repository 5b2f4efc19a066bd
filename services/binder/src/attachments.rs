//! The binder's record of what it plugged: one small JSON file per attachment (container id +
//! interface name) under the state directory, written before plugging and removed after
//! unplugging. A restarted binder reloads them, so DEL, CHECK and GC keep working for pods that
//! were plugged before the restart, and a crash mid-ADD leaves a record for DEL or GC to clean.

use std::collections::BTreeMap;
use std::io;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use serde::{Deserialize, Serialize};

use crate::hostport::mapping::PortMapping;

/// One attachment.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Attachment {
    pub container_id: String,
    pub ifname: String,
    /// The netns path given at ADD.
    pub netns: String,
    pub host_ifname: String,
    pub pod_uid: String,
    pub pod_namespace: String,
    pub pod_name: String,
    pub vif_id: String,
    /// "bridge" or "ovs".
    pub driver: String,
    /// The bridge the host end is attached to.
    pub bridge: String,
    /// The pod's addresses (without prefix length), for its host ports.
    #[serde(default)]
    pub ips: Vec<IpAddr>,
    /// The host ports the runtime asked for (`runtimeConfig.portMappings`).
    #[serde(default)]
    pub port_mappings: Vec<PortMapping>,
}

impl Attachment {
    /// The key: container id and interface name.
    pub fn key(&self) -> (String, String) {
        (self.container_id.clone(), self.ifname.clone())
    }
}

/// The attachment records, on disk and in memory; cheap to clone.
#[derive(Clone, Debug)]
pub struct Attachments {
    dir: PathBuf,
    map: Arc<Mutex<BTreeMap<(String, String), Attachment>>>,
}

impl Attachments {
    /// Opens (creating) the directory and loads every record. Unreadable records are logged and
    /// set aside (renamed `*.bad`), never silently deleted.
    pub fn open(dir: &Path) -> io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let mut map = BTreeMap::new();
        for entry in std::fs::read_dir(dir)? {
            let path = entry?.path();
            if path.extension().is_none_or(|e| e != "json") {
                continue;
            }
            match std::fs::read(&path)
                .map_err(|e| e.to_string())
                .and_then(|b| serde_json::from_slice::<Attachment>(&b).map_err(|e| e.to_string()))
            {
                Ok(a) => {
                    map.insert(a.key(), a);
                }
                Err(e) => {
                    tracing::error!(path = %path.display(), error = e, "unreadable attachment record; set aside");
                    let _ = std::fs::rename(&path, path.with_extension("bad"));
                }
            }
        }
        tracing::info!(dir = %dir.display(), count = map.len(), "attachment records loaded");
        Ok(Self { dir: dir.to_path_buf(), map: Arc::new(Mutex::new(map)) })
    }

    fn lock(&self) -> MutexGuard<'_, BTreeMap<(String, String), Attachment>> {
        self.map.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn path(&self, container_id: &str, ifname: &str) -> PathBuf {
        let clean = |s: &str| {
            s.chars()
                .map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '.' { c } else { '_' })
                .collect::<String>()
        };
        self.dir.join(format!("{}__{}.json", clean(container_id), clean(ifname)))
    }

    /// Writes a record atomically (temporary file, then rename), so a crash never leaves half a
    /// record. There is deliberately no fsync on this hot path: what a record describes (veths,
    /// pod namespaces) lives in the kernel and does not survive a machine crash either, while a
    /// binder crash cannot lose a renamed file.
    pub fn put(&self, a: &Attachment) -> io::Result<()> {
        let path = self.path(&a.container_id, &a.ifname);
        let tmp = path.with_extension("tmp");
        let bytes = serde_json::to_vec_pretty(a).map_err(io::Error::other)?;
        {
            use std::io::Write;
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(&bytes)?;
        }
        std::fs::rename(&tmp, &path)?;
        self.lock().insert(a.key(), a.clone());
        Ok(())
    }

    /// Removes a record; absent is fine.
    pub fn remove(&self, container_id: &str, ifname: &str) -> io::Result<()> {
        match std::fs::remove_file(self.path(container_id, ifname)) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        self.lock().remove(&(container_id.to_string(), ifname.to_string()));
        Ok(())
    }

    /// The record of an attachment.
    pub fn get(&self, container_id: &str, ifname: &str) -> Option<Attachment> {
        self.lock().get(&(container_id.to_string(), ifname.to_string())).cloned()
    }

    /// Every record.
    pub fn all(&self) -> Vec<Attachment> {
        self.lock().values().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn att(c: &str) -> Attachment {
        Attachment {
            container_id: c.into(),
            ifname: "eth0".into(),
            netns: "/var/run/netns/x".into(),
            host_ifname: "kv123".into(),
            pod_uid: "u".into(),
            pod_namespace: "ns".into(),
            pod_name: "p".into(),
            vif_id: "v".into(),
            driver: "bridge".into(),
            bridge: "kuryr0".into(),
            ips: vec!["10.0.0.5".parse().unwrap()],
            port_mappings: Vec::new(),
        }
    }

    #[test]
    fn records_survive_a_restart_and_bad_ones_are_set_aside() {
        let dir = tempfile::tempdir().unwrap();
        let a = Attachments::open(dir.path()).unwrap();
        a.put(&att("c1")).unwrap();
        a.put(&att("c2/../x")).unwrap();
        a.remove("c1", "eth0").unwrap();
        a.remove("c1", "eth0").unwrap();
        std::fs::write(dir.path().join("junk.json"), b"{not json").unwrap();
        let b = Attachments::open(dir.path()).unwrap();
        assert_eq!(b.all(), vec![att("c2/../x")]);
        assert!(dir.path().join("junk.bad").exists());
        // Sanitised names stay inside the directory.
        assert!(std::fs::read_dir(dir.path()).unwrap().all(|e| e.unwrap().path().parent() == Some(dir.path())));
    }

    #[test]
    fn records_written_before_host_ports_existed_still_load() {
        let dir = tempfile::tempdir().unwrap();
        let old = r#"{"container_id":"c9","ifname":"eth0","netns":"/x","host_ifname":"kv1","pod_uid":"u",
            "pod_namespace":"ns","pod_name":"p","vif_id":"v","driver":"bridge","bridge":"kuryr0"}"#;
        std::fs::write(dir.path().join("c9__eth0.json"), old).unwrap();
        let a = Attachments::open(dir.path()).unwrap();
        let got = a.get("c9", "eth0").unwrap();
        assert!(got.ips.is_empty() && got.port_mappings.is_empty(), "{got:?}");
    }
}

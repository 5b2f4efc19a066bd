//! The binder's record of what it plugged: one small JSON file per attachment (container id +
//! interface name) under the state directory, written before plugging and removed after
//! unplugging. A restarted binder reloads them, so DEL, CHECK and GC keep working for pods that
//! were plugged before the restart, and a crash mid-ADD leaves a record for DEL or GC to clean.

use std::collections::{BTreeMap, HashMap};
use std::io;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use serde::{Deserialize, Serialize};

use crate::hostport::mapping::PortMapping;

/// Where an attachment is in its life.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum State {
    /// ADD is plugging it. A record found in this state at start-up belongs to an ADD the binder
    /// died in (a crash, `kill -9`, a panic in a release build, which aborts): the runtime saw
    /// that ADD fail, so what it made is rolled back ([`crate::cni::CniService::recover`]).
    Adding,
    /// ADD returned it to the runtime: live until DEL or GC. Records written before states
    /// existed read as this, so an upgrade never rolls back a live pod.
    #[default]
    Ready,
}

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
    /// "bridge", "ovs" or "vlan" (then `bridge` is the uplink).
    pub driver: String,
    /// The bridge the host end is attached to.
    pub bridge: String,
    /// The pod's addresses (without prefix length), for its host ports.
    #[serde(default)]
    pub ips: Vec<IpAddr>,
    /// The host ports the runtime asked for (`runtimeConfig.portMappings`).
    #[serde(default)]
    pub port_mappings: Vec<PortMapping>,
    #[serde(default)]
    pub state: State,
    /// The MACs of the host and pod ends, once plugged: a repeated ADD answers with them.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub host_mac: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub sandbox_mac: String,
    /// For a further interface of the pod (`k8s.v1.cni.cncf.io/networks`), the interface name of
    /// the primary attachment it was plugged with: it lives and goes with that one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub primary: Option<String>,
    /// ADD answered before the allocator had the plugged report (a VIF ready when plugged): the
    /// report is still to be delivered, in the background, and at the binder's next start if it
    /// exits first.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub report_pending: bool,
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
        self.write(a)?;
        self.lock().insert(a.key(), a.clone());
        Ok(())
    }

    /// Takes the pod for `a` unless another attachment of the same pod (another container or
    /// interface) is `live`; in one step under the lock, so two ADDs can never both claim one pod.
    /// Returns the pod's other records, none of them live (stale: for the caller to remove), or
    /// the live one that stood in the way (nothing recorded then).
    ///
    /// The claim is held in memory only: nothing is made for `a` before the caller writes its
    /// record with [`Attachments::put`], so a binder that dies before that leaves nothing behind
    /// to roll back (and an ADD saves a file write).
    pub fn claim(
        &self,
        a: &Attachment,
        live: impl Fn(&Attachment) -> bool,
    ) -> Result<Vec<Attachment>, Box<Attachment>> {
        let mut map = self.lock();
        // The pod's further interfaces plugged with `a` are part of `a`, not others.
        let part_of_a = |o: &Attachment| o.container_id == a.container_id && o.primary.as_ref() == Some(&a.ifname);
        let others: Vec<Attachment> =
            map.values().filter(|o| o.pod_uid == a.pod_uid && o.key() != a.key() && !part_of_a(o)).cloned().collect();
        if let Some(l) = others.iter().find(|o| live(o)) {
            return Err(Box::new(l.clone()));
        }
        map.insert(a.key(), a.clone());
        Ok(others)
    }

    fn write(&self, a: &Attachment) -> io::Result<()> {
        let path = self.path(&a.container_id, &a.ifname);
        let tmp = path.with_extension("tmp");
        let bytes = serde_json::to_vec_pretty(a).map_err(io::Error::other)?;
        {
            use std::io::Write;
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(&bytes)?;
        }
        std::fs::rename(&tmp, &path)
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

    /// The records `keep` selects; only those are copied.
    pub fn filter(&self, keep: impl Fn(&Attachment) -> bool) -> Vec<Attachment> {
        self.lock().values().filter(|a| keep(a)).cloned().collect()
    }
}

type Key = (String, String);

/// One async lock per attachment key: ADD, DEL, GC and the rollback of a failed ADD of the same
/// container and interface run one after another, so that a retried ADD never meets the
/// half-made or half-undone work of an earlier one. Entries go away with their last holder.
#[derive(Clone, Debug, Default)]
pub struct KeyLocks {
    map: Arc<Mutex<HashMap<Key, Arc<tokio::sync::Mutex<()>>>>>,
}

/// Holds the lock of one key until dropped.
#[derive(Debug)]
pub struct KeyGuard {
    guard: Option<tokio::sync::OwnedMutexGuard<()>>,
    key: Key,
    locks: KeyLocks,
}

impl KeyLocks {
    /// Waits for and takes the lock of `(container_id, ifname)`.
    pub async fn lock(&self, container_id: &str, ifname: &str) -> KeyGuard {
        let key = (container_id.to_string(), ifname.to_string());
        let m = self.map.lock().unwrap_or_else(PoisonError::into_inner).entry(key.clone()).or_default().clone();
        KeyGuard { guard: Some(m.lock_owned().await), key, locks: self.clone() }
    }

    /// Keys with a lock held or awaited (for tests).
    pub fn len(&self) -> usize {
        self.map.lock().unwrap_or_else(PoisonError::into_inner).len()
    }

    /// Whether no key is locked.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Drop for KeyGuard {
    fn drop(&mut self) {
        drop(self.guard.take());
        let mut map = self.locks.map.lock().unwrap_or_else(PoisonError::into_inner);
        // Only the map holds it now: nobody holds or awaits this key.
        if map.get(&self.key).is_some_and(|m| Arc::strong_count(m) == 1) {
            map.remove(&self.key);
        }
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
            state: State::Ready,
            host_mac: String::new(),
            sandbox_mac: String::new(),
            primary: None,
            report_pending: false,
        }
    }

    #[test]
    fn records_without_a_state_are_live() {
        let old = r#"{"container_id":"c","ifname":"eth0","netns":"/n","host_ifname":"kv1","pod_uid":"u",
            "pod_namespace":"ns","pod_name":"p","vif_id":"v","driver":"bridge","bridge":"kuryr0"}"#;
        let a: Attachment = serde_json::from_str(old).unwrap();
        assert_eq!(a.state, State::Ready);
        let mut b = att("c");
        b.state = State::Adding;
        let back: Attachment = serde_json::from_slice(&serde_json::to_vec(&b).unwrap()).unwrap();
        assert_eq!(back.state, State::Adding);
    }

    #[test]
    fn a_pod_is_claimed_once_while_live() {
        let dir = tempfile::tempdir().unwrap();
        let a = Attachments::open(dir.path()).unwrap();
        let first = att("c1");
        assert_eq!(a.claim(&first, |_| true).unwrap(), vec![]);
        // Held in memory: the record is written by put, before anything is plugged.
        assert!(a.get("c1", "eth0").is_some());
        assert!(Attachments::open(dir.path()).unwrap().get("c1", "eth0").is_none());
        // Another container of the same pod: refused while the first is live ...
        let second = att("c2");
        assert_eq!(*a.claim(&second, |_| true).unwrap_err(), first);
        assert!(a.get("c2", "eth0").is_none());
        // ... taken, with the first handed back as stale, once it is not.
        assert_eq!(a.claim(&second, |_| false).unwrap(), vec![first.clone()]);
        // The same key again is not a conflict with itself.
        assert!(a.claim(&second, |o| o.container_id == "c2").is_ok());
    }

    #[tokio::test]
    async fn key_locks_serialise_one_key_and_clean_up() {
        let locks = KeyLocks::default();
        let g = locks.lock("c", "eth0").await;
        let other = locks.lock("c", "eth1").await;
        let l2 = locks.clone();
        let waiter = tokio::spawn(async move { l2.lock("c", "eth0").await });
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        drop(g);
        drop(waiter.await.unwrap());
        drop(other);
        assert!(locks.is_empty());
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

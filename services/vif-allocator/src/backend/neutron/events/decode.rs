//! Neutron's push of a port, as it arrives: an oslo.messaging RPC cast (`method: push`), in the
//! 2.0 envelope (`{"oslo.version": "2.0", "oslo.message": "<json>"}`) or bare, whose
//! `args.resource_list` holds versioned Port objects (`versioned_object.data`: `id`, `status`,
//! `revision_number`, `device_id`, `device_owner`, `bindings[].host`) and `args.event_type` says
//! `updated` or `deleted`.

use serde_json::Value;

/// One port as Neutron pushed it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PortEvent {
    /// The port id.
    pub id: String,
    /// `ACTIVE`, `DOWN`, `BUILD`, `ERROR`; `None` for a deletion.
    pub status: Option<String>,
    /// Neutron's revision of the port: later changes have higher numbers.
    pub revision: Option<u64>,
    /// The device the port belongs to (a pod's uid for kuryr's ports).
    pub device_id: Option<String>,
    /// Its device owner.
    pub device_owner: Option<String>,
    /// Hosts of its bindings.
    pub hosts: Vec<String>,
    /// The port was deleted.
    pub deleted: bool,
}

impl PortEvent {
    /// Whether Neutron reports it ACTIVE.
    pub fn is_active(&self) -> bool {
        self.status.as_deref() == Some("ACTIVE")
    }
}

/// Why a message is not understood.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// Not JSON, or no object where one belongs.
    #[error("not an oslo.messaging message: {0}")]
    Envelope(String),
    /// An RPC message other than a push (nothing to do with ports).
    #[error("method {0:?}, not push")]
    NotPush(String),
}

/// The ports of one pushed message (objects other than ports are skipped).
pub fn decode(body: &[u8]) -> Result<Vec<PortEvent>, DecodeError> {
    let outer: Value = serde_json::from_slice(body).map_err(|e| DecodeError::Envelope(e.to_string()))?;
    let msg = match outer.get("oslo.message") {
        Some(Value::String(inner)) => {
            serde_json::from_str::<Value>(inner).map_err(|e| DecodeError::Envelope(format!("oslo.message: {e}")))?
        }
        Some(_) => return Err(DecodeError::Envelope("oslo.message is not a string".into())),
        None => outer,
    };
    let method = msg.get("method").and_then(Value::as_str).unwrap_or_default();
    if method != "push" {
        return Err(DecodeError::NotPush(method.to_string()));
    }
    let args = msg.get("args").ok_or_else(|| DecodeError::Envelope("a push without args".into()))?;
    let deleted = args.get("event_type").and_then(Value::as_str) == Some("deleted");
    let list = args
        .get("resource_list")
        .and_then(Value::as_array)
        .ok_or_else(|| DecodeError::Envelope("a push without resource_list".into()))?;
    let s = |d: &Value, k: &str| d.get(k).and_then(Value::as_str).map(str::to_string);
    Ok(list
        .iter()
        .filter(|o| o.get("versioned_object.name").and_then(Value::as_str) == Some("Port"))
        .filter_map(|o| o.get("versioned_object.data"))
        .filter_map(|d| {
            let id = s(d, "id")?;
            let hosts = d
                .get("bindings")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter_map(|b| b.get("versioned_object.data").and_then(|b| s(b, "host")))
                .filter(|h| !h.is_empty())
                .collect();
            Some(PortEvent {
                id,
                status: if deleted { None } else { s(d, "status") },
                revision: d.get("revision_number").and_then(Value::as_u64),
                device_id: s(d, "device_id"),
                device_owner: s(d, "device_owner"),
                hosts,
                deleted,
            })
        })
        .collect())
}

#[cfg(test)]
pub(crate) mod tests {
    #![allow(clippy::unwrap_used)]

    use serde_json::json;

    use super::*;

    /// A push as Neutron 29 sends it (fields trimmed to those read, plus a few others).
    pub(crate) fn push(event_type: &str, id: &str, status: &str, revision: u64, device_id: &str) -> Vec<u8> {
        let inner = json!({
            "method": "push",
            "args": {
                "resource_list": [{
                    "versioned_object.name": "Port",
                    "versioned_object.namespace": "versionedobjects",
                    "versioned_object.version": "1.11",
                    "versioned_object.data": {
                        "id": id, "status": status, "revision_number": revision, "device_id": device_id,
                        "device_owner": "compute:kuryr", "network_id": "net", "admin_state_up": true,
                        "bindings": [{"versioned_object.name": "PortBinding",
                                      "versioned_object.data": {"host": "node-1", "status": "ACTIVE", "vif_type": "ovs"}}],
                    },
                    "versioned_object.changes": ["status"],
                }],
                "event_type": event_type,
            },
            "version": "1.1",
            "namespace": "resources",
            "_unique_id": "5f2c",
        });
        serde_json::to_vec(&json!({"oslo.version": "2.0", "oslo.message": inner.to_string()})).unwrap()
    }

    #[test]
    fn a_pushed_port_update_and_deletion() {
        let evs = decode(&push("updated", "p1", "ACTIVE", 7, "uid-1")).unwrap();
        assert_eq!(
            evs,
            [PortEvent {
                id: "p1".into(),
                status: Some("ACTIVE".into()),
                revision: Some(7),
                device_id: Some("uid-1".into()),
                device_owner: Some("compute:kuryr".into()),
                hosts: vec!["node-1".into()],
                deleted: false,
            }]
        );
        assert!(evs[0].is_active());
        let gone = decode(&push("deleted", "p1", "DOWN", 8, "")).unwrap();
        assert!(gone[0].deleted && gone[0].status.is_none() && !gone[0].is_active());
    }

    #[test]
    fn bare_messages_other_objects_and_garbage() {
        let bare = json!({"method": "push", "args": {"event_type": "updated", "resource_list": [
            {"versioned_object.name": "Network", "versioned_object.data": {"id": "n1"}},
            {"versioned_object.name": "Port", "versioned_object.data": {"id": "p2", "status": "DOWN"}},
            {"versioned_object.name": "Port", "versioned_object.data": {"status": "DOWN"}},
        ]}});
        let evs = decode(bare.to_string().as_bytes()).unwrap();
        assert_eq!(evs.len(), 1, "the network and the port without id are skipped");
        assert_eq!((evs[0].id.as_str(), evs[0].revision), ("p2", None));
        assert!(matches!(decode(b"not json"), Err(DecodeError::Envelope(_))));
        assert!(matches!(decode(br#"{"oslo.message": 3}"#), Err(DecodeError::Envelope(_))));
        let other =
            json!({"oslo.version": "2.0", "oslo.message": json!({"method": "port_update", "args": {}}).to_string()});
        assert_eq!(decode(other.to_string().as_bytes()), Err(DecodeError::NotPush("port_update".into())));
        let no_list = json!({"method": "push", "args": {"event_type": "updated"}});
        assert!(matches!(decode(no_list.to_string().as_bytes()), Err(DecodeError::Envelope(_))));
    }
}

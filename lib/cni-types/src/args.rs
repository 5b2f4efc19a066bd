//! `CNI_ARGS`: `K=V;K=V` pairs from the runtime.

use std::collections::BTreeMap;

use crate::CniError;

/// The `CNI_ARGS` keys kuryr reads. containerd and CRI-O send all four, plus `IgnoreUnknown=1`.
pub mod keys {
    pub const IGNORE_UNKNOWN: &str = "IgnoreUnknown";
    pub const K8S_POD_NAMESPACE: &str = "K8S_POD_NAMESPACE";
    pub const K8S_POD_NAME: &str = "K8S_POD_NAME";
    pub const K8S_POD_UID: &str = "K8S_POD_UID";
    pub const K8S_POD_INFRA_CONTAINER_ID: &str = "K8S_POD_INFRA_CONTAINER_ID";
}

const KNOWN: [&str; 5] = [
    keys::IGNORE_UNKNOWN,
    keys::K8S_POD_NAMESPACE,
    keys::K8S_POD_NAME,
    keys::K8S_POD_UID,
    keys::K8S_POD_INFRA_CONTAINER_ID,
];

/// Parsed `CNI_ARGS`.
///
/// As in the reference Go library, a key kuryr does not know is an error unless the runtime set
/// `IgnoreUnknown` to a true value; with it, unknown keys are kept and readable with [`get`].
///
/// [`get`]: CniArgs::get
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CniArgs {
    pairs: BTreeMap<String, String>,
    ignore_unknown: bool,
}

impl CniArgs {
    /// Parses `K=V;K=V`. Empty segments (a trailing `;`) are skipped; a segment without `=` or with
    /// an empty key is code 4 naming the segment; so is an unknown key without `IgnoreUnknown` and an
    /// `IgnoreUnknown` that is not a boolean (`1`, `0`, `true`, `false`, any case). A value may
    /// contain `=`; a repeated key keeps its last value.
    pub fn parse(s: &str) -> Result<Self, CniError> {
        let mut pairs = BTreeMap::new();
        for seg in s.split(';').filter(|seg| !seg.is_empty()) {
            let Some((k, v)) = seg.split_once('=').filter(|(k, _)| !k.is_empty()) else {
                return Err(CniError::invalid_environment(format!(
                    "CNI_ARGS has the malformed pair \"{seg}\"; expected KEY=VALUE pairs separated by ';'"
                )));
            };
            pairs.insert(k.to_string(), v.to_string());
        }
        let ignore_unknown = match pairs.get(keys::IGNORE_UNKNOWN).map(|v| v.to_ascii_lowercase()) {
            None => false,
            Some(v) if v == "1" || v == "true" => true,
            Some(v) if v == "0" || v == "false" => false,
            Some(v) => {
                return Err(CniError::invalid_environment(format!(
                    "CNI_ARGS has IgnoreUnknown=\"{v}\"; expected 1, 0, true or false"
                )));
            }
        };
        if !ignore_unknown && let Some(k) = pairs.keys().find(|k| !KNOWN.contains(&k.as_str())) {
            return Err(CniError::invalid_environment(format!(
                "CNI_ARGS has the unknown key \"{k}\" and no IgnoreUnknown=1"
            )));
        }
        Ok(Self { pairs, ignore_unknown })
    }

    /// The value of any key, known or not.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.pairs.get(key).map(String::as_str)
    }

    /// Whether `IgnoreUnknown` was set to a true value.
    pub fn ignore_unknown(&self) -> bool {
        self.ignore_unknown
    }

    /// `K8S_POD_NAMESPACE`, when present and non-empty.
    pub fn pod_namespace(&self) -> Option<&str> {
        self.non_empty(keys::K8S_POD_NAMESPACE)
    }

    /// `K8S_POD_NAME`, when present and non-empty.
    pub fn pod_name(&self) -> Option<&str> {
        self.non_empty(keys::K8S_POD_NAME)
    }

    /// `K8S_POD_UID`, when present and non-empty.
    pub fn pod_uid(&self) -> Option<&str> {
        self.non_empty(keys::K8S_POD_UID)
    }

    /// `K8S_POD_INFRA_CONTAINER_ID`, when present and non-empty.
    pub fn pod_infra_container_id(&self) -> Option<&str> {
        self.non_empty(keys::K8S_POD_INFRA_CONTAINER_ID)
    }

    fn non_empty(&self, key: &str) -> Option<&str> {
        self.get(key).filter(|v| !v.is_empty())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONTAINERD: &str = "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web-0;\
                              K8S_POD_INFRA_CONTAINER_ID=abc123;K8S_POD_UID=1f2e-33";

    #[test]
    fn parses_what_containerd_sends() {
        let a = CniArgs::parse(CONTAINERD).unwrap();
        assert!(a.ignore_unknown());
        assert_eq!(a.pod_namespace(), Some("default"));
        assert_eq!(a.pod_name(), Some("web-0"));
        assert_eq!(a.pod_uid(), Some("1f2e-33"));
        assert_eq!(a.pod_infra_container_id(), Some("abc123"));
    }

    #[test]
    fn table() {
        // (input, Ok(expected pod name) | Err(substring of the message))
        let table: &[(&str, Result<Option<&str>, &str>)] = &[
            ("", Ok(None)),
            (";", Ok(None)),
            ("K8S_POD_NAME=a;", Ok(Some("a"))),
            ("K8S_POD_NAME=", Ok(None)),
            ("K8S_POD_NAME=a=b", Ok(Some("a=b"))),
            ("K8S_POD_NAME=a;K8S_POD_NAME=b", Ok(Some("b"))),
            ("IgnoreUnknown=true;FOO=bar;K8S_POD_NAME=x", Ok(Some("x"))),
            ("FOO=bar;IgnoreUnknown=TRUE", Ok(None)),
            ("K8S_POD_NAME", Err("\"K8S_POD_NAME\"")),
            ("K8S_POD_NAME=a;junk", Err("\"junk\"")),
            ("=v", Err("\"=v\"")),
            ("FOO=bar", Err("unknown key \"FOO\"")),
            ("FOO=bar;IgnoreUnknown=0", Err("unknown key \"FOO\"")),
            ("IgnoreUnknown=yes", Err("IgnoreUnknown=\"yes\"")),
        ];
        for (input, want) in table {
            match (CniArgs::parse(input), want) {
                (Ok(a), Ok(name)) => assert_eq!(a.pod_name(), *name, "{input}"),
                (Err(e), Err(sub)) => {
                    assert_eq!(e.code, 4, "{input}");
                    assert!(e.msg.contains(sub), "{input}: {e}");
                }
                (got, want) => panic!("{input}: got {got:?}, want {want:?}"),
            }
        }
    }

    #[test]
    fn unknown_keys_are_kept_when_ignored() {
        let a = CniArgs::parse("IgnoreUnknown=1;FOO=bar").unwrap();
        assert_eq!(a.get("FOO"), Some("bar"));
        assert_eq!(a.get("BAR"), None);
    }
}

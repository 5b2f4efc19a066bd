//! The network configuration the runtime writes to the plugin's stdin.

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;
use serde_json::Value;

use crate::{CniError, CniResult, CniVersion, Command};

/// The largest configuration accepted. Real ones are a few hundred bytes (a `prevResult` adds a
/// kilobyte or two); anything near this is a runtime bug, not a network to plug.
pub const MAX_CONFIG_BYTES: usize = 1 << 20;

/// Where kuryr-binder listens when the configuration does not say.
pub const DEFAULT_BINDER_SOCKET: &str = "/run/kuryr/binder.sock";

/// How long ADD may take by default. The binder may wait for Neutron to create and activate the
/// port; the runtime's own sandbox timeout is about 4 minutes, so 2 leaves room for its retry.
pub const DEFAULT_TIMEOUT_SECONDS: u64 = 120;

/// The longest `timeoutSeconds` accepted. The runtime's own sandbox timeout is about 4
/// minutes; an hour is far past any real ADD, and far below what a gRPC deadline can carry
/// (10^8 hours), so the deadline is always sent as the runtime asked.
pub const MAX_TIMEOUT_SECONDS: u64 = 3600;

/// The longest any operation but ADD may take: DEL, CHECK, STATUS and GC touch only local state,
/// so a binder that has not answered in this long is stuck, and the runtime should hear so.
pub const NON_ADD_TIMEOUT_CAP_SECONDS: u64 = 30;

/// One entry of `cni.dev/valid-attachments` (GC): an attachment the runtime still uses.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct ValidAttachment {
    #[serde(rename = "containerID")]
    pub container_id: String,
    pub ifname: String,
}

/// A parsed network configuration. Fields the plugin does not know are ignored.
#[derive(Clone, Debug, PartialEq)]
pub struct NetConf {
    pub cni_version: CniVersion,
    /// The network name.
    pub name: String,
    /// The plugin type (`kuryr-cni`).
    pub plugin_type: String,
    /// Capability arguments from the runtime, uninterpreted.
    pub runtime_config: Option<Value>,
    /// The result of the previous plugin in the chain, or of ADD for CHECK and DEL.
    pub prev_result: Option<CniResult>,
    /// GC: the attachments to keep. `None` when the key is absent.
    pub valid_attachments: Option<Vec<ValidAttachment>>,
    /// kuryr: the binder's unix socket (`binderSocket`).
    pub binder_socket: PathBuf,
    /// kuryr: the deadline for ADD, in seconds (`timeoutSeconds`); see [`NetConf::timeout`].
    pub timeout_seconds: u64,
    /// kuryr: where the shim appends its log lines (`logFile`); stderr when `None`.
    pub log_file: Option<PathBuf>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Wire {
    cni_version: Option<String>,
    name: Option<String>,
    #[serde(rename = "type")]
    plugin_type: Option<String>,
    runtime_config: Option<Value>,
    prev_result: Option<Value>,
    #[serde(rename = "cni.dev/valid-attachments")]
    valid_attachments: Option<Vec<ValidAttachment>>,
    binder_socket: Option<String>,
    timeout_seconds: Option<u64>,
    log_file: Option<String>,
}

impl NetConf {
    /// Parses the configuration from stdin's bytes.
    ///
    /// Errors, in the order checked: larger than [`MAX_CONFIG_BYTES`] → 7 ("oversized config",
    /// with the size); not JSON → 6 with serde's line and column; a field of the wrong type → 7;
    /// `cniVersion` missing → 7, unsupported → 1 (naming it and the supported ones); `name` or
    /// `type` missing or empty → 7 naming the field; `timeoutSeconds` 0, a relative `binderSocket`
    /// or `logFile`, or an invalid `prevResult` → 7.
    pub fn parse(bytes: &[u8]) -> Result<Self, CniError> {
        Self::check_size(bytes.len() as u64)?;
        // serde reads a struct from a JSON array too (positionally); a configuration is an object.
        let is_object = bytes.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{');
        let w: Wire = match serde_json::from_slice(bytes) {
            Ok(w) if is_object => w,
            Err(e) if e.is_syntax() || e.is_eof() || e.is_io() => {
                return Err(CniError::decode(format!("cannot decode the network configuration: {e}")));
            }
            Ok(_) => return Err(CniError::invalid_config("the network configuration is not a JSON object")),
            Err(_) if !is_object => {
                return Err(CniError::invalid_config("the network configuration is not a JSON object"));
            }
            Err(e) => return Err(CniError::invalid_config(format!("invalid network configuration: {e}"))),
        };
        let version = w.cni_version.ok_or_else(|| missing("cniVersion"))?;
        let cni_version = CniVersion::parse(&version)?;
        let name = w.name.filter(|s| !s.is_empty()).ok_or_else(|| missing("name"))?;
        let plugin_type = w.plugin_type.filter(|s| !s.is_empty()).ok_or_else(|| missing("type"))?;
        let timeout_seconds = w.timeout_seconds.unwrap_or(DEFAULT_TIMEOUT_SECONDS);
        if timeout_seconds == 0 || timeout_seconds > MAX_TIMEOUT_SECONDS {
            return Err(CniError::invalid_config(format!(
                "timeoutSeconds must be from 1 to {MAX_TIMEOUT_SECONDS}, not {timeout_seconds}"
            )));
        }
        let binder_socket = absolute("binderSocket", w.binder_socket.as_deref().unwrap_or(DEFAULT_BINDER_SOCKET))?;
        let log_file = w.log_file.as_deref().map(|p| absolute("logFile", p)).transpose()?;
        let prev_result = w
            .prev_result
            .filter(|v| !v.is_null())
            .map(|v| CniResult::from_value(&v))
            .transpose()
            .map_err(|e| CniError::invalid_config(format!("prevResult: {e}")))?;
        Ok(Self {
            cni_version,
            name,
            plugin_type,
            runtime_config: w.runtime_config,
            prev_result,
            valid_attachments: w.valid_attachments,
            binder_socket,
            timeout_seconds,
            log_file,
        })
    }

    /// Refuses a configuration of `len` bytes when it is larger than [`MAX_CONFIG_BYTES`] (code 7,
    /// "oversized config", with the size): for readers that stop buffering stdin at the limit.
    pub fn check_size(len: u64) -> Result<(), CniError> {
        if len > MAX_CONFIG_BYTES as u64 {
            return Err(CniError::invalid_config(format!(
                "oversized config: {len} bytes on stdin, the limit is {MAX_CONFIG_BYTES}"
            )));
        }
        Ok(())
    }

    /// The deadline of `command`: `timeoutSeconds` for ADD, and at most
    /// [`NON_ADD_TIMEOUT_CAP_SECONDS`] for the others.
    pub fn timeout(&self, command: Command) -> Duration {
        let secs = match command {
            Command::Add => self.timeout_seconds,
            _ => self.timeout_seconds.min(NON_ADD_TIMEOUT_CAP_SECONDS),
        };
        Duration::from_secs(secs)
    }
}

fn missing(field: &str) -> CniError {
    CniError::invalid_config(format!("the network configuration lacks \"{field}\""))
}

fn absolute(field: &str, path: &str) -> Result<PathBuf, CniError> {
    if !path.starts_with('/') {
        return Err(CniError::invalid_config(format!("{field} \"{path}\" must be an absolute path")));
    }
    Ok(PathBuf::from(path))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    const MINIMAL: &str = r#"{"cniVersion":"1.1.0","name":"kuryr","type":"kuryr-cni"}"#;

    #[test]
    fn minimal_config_gets_the_defaults() {
        let c = NetConf::parse(MINIMAL.as_bytes()).unwrap();
        assert_eq!(c.cni_version, CniVersion::V1_1_0);
        assert_eq!(c.name, "kuryr");
        assert_eq!(c.plugin_type, "kuryr-cni");
        assert_eq!(c.binder_socket, PathBuf::from("/run/kuryr/binder.sock"));
        assert_eq!(c.timeout_seconds, 120);
        assert_eq!(c.timeout(Command::Add), Duration::from_secs(120));
        for cmd in [Command::Del, Command::Check, Command::Status, Command::Gc] {
            assert_eq!(c.timeout(cmd), Duration::from_secs(30), "{cmd}");
        }
        assert_eq!((c.log_file, c.prev_result, c.runtime_config, c.valid_attachments), (None, None, None, None));
    }

    #[test]
    fn full_config() {
        let conf = json!({
            "cniVersion": "0.4.0",
            "name": "kuryr",
            "type": "kuryr-cni",
            "binderSocket": "/tmp/b.sock",
            "timeoutSeconds": 10,
            "logFile": "/var/log/kuryr-cni.log",
            "runtimeConfig": {"portMappings": [{"hostPort": 8080}]},
            "prevResult": {"cniVersion": "0.4.0", "ips": [{"version": "4", "address": "10.0.0.5/24"}]},
            "cni.dev/valid-attachments": [{"containerID": "abc", "ifname": "eth0"}],
            "ipam": {"type": "ignored"},
            "somethingElse": [1, 2, 3],
        });
        let c = NetConf::parse(conf.to_string().as_bytes()).unwrap();
        assert_eq!(c.cni_version, CniVersion::V0_4_0);
        assert_eq!(c.binder_socket, PathBuf::from("/tmp/b.sock"));
        assert_eq!(c.timeout(Command::Add), Duration::from_secs(10));
        assert_eq!(c.timeout(Command::Del), Duration::from_secs(10));
        assert_eq!(c.log_file, Some(PathBuf::from("/var/log/kuryr-cni.log")));
        assert_eq!(c.runtime_config, Some(json!({"portMappings": [{"hostPort": 8080}]})));
        assert_eq!(c.prev_result.unwrap().ips[0].address.to_string(), "10.0.0.5/24");
        assert_eq!(
            c.valid_attachments,
            Some(vec![ValidAttachment { container_id: "abc".into(), ifname: "eth0".into() }])
        );
    }

    #[test]
    fn errors() {
        // (config, code, substring of the message)
        let table: &[(&str, u32, &str)] = &[
            ("", 6, "EOF while parsing a value at line 1 column 0"),
            ("{\"cniVersion\": ", 6, "at line 1 column 15"),
            ("not json", 6, "expected ident at line 1 column 2"),
            ("[1]", 7, "not a JSON object"),
            (r#"["1.1.0","n","t",null,null,null,null,null,null]"#, 7, "not a JSON object"),
            ("5", 7, "not a JSON object"),
            (r#"{"cniVersion":"1.0.0","name":5,"type":"t"}"#, 7, "invalid type: integer `5`, expected a string"),
            (r#"{"name":"n","type":"t"}"#, 7, "\"cniVersion\""),
            (
                r#"{"cniVersion":"0.2.0","name":"n","type":"t"}"#,
                1,
                "\"0.2.0\"; supported: 0.3.0, 0.3.1, 0.4.0, 1.0.0, 1.1.0",
            ),
            (r#"{"cniVersion":"1.0.0","type":"t"}"#, 7, "\"name\""),
            (r#"{"cniVersion":"1.0.0","name":"","type":"t"}"#, 7, "\"name\""),
            (r#"{"cniVersion":"1.0.0","name":"n"}"#, 7, "\"type\""),
            (r#"{"cniVersion":"1.0.0","name":"n","type":"t","timeoutSeconds":0}"#, 7, "timeoutSeconds"),
            (r#"{"cniVersion":"1.0.0","name":"n","type":"t","timeoutSeconds":-1}"#, 7, "invalid value: integer `-1`"),
            (r#"{"cniVersion":"1.0.0","name":"n","type":"t","timeoutSeconds":3601}"#, 7, "from 1 to 3600, not 3601"),
            (r#"{"cniVersion":"1.0.0","name":"n","type":"t","timeoutSeconds":360000000000}"#, 7, "timeoutSeconds"),
            (
                r#"{"cniVersion":"1.0.0","name":"n","type":"t","timeoutSeconds":18446744073709551615}"#,
                7,
                "timeoutSeconds",
            ),
            (r#"{"cniVersion":"1.0.0","name":"n","type":"t","timeoutSeconds":1e300}"#, 7, "expected u64"),
            (r#"{"cniVersion":"1.0.0","name":"n","type":"t","binderSocket":"b.sock"}"#, 7, "binderSocket \"b.sock\""),
            (r#"{"cniVersion":"1.0.0","name":"n","type":"t","logFile":"x.log"}"#, 7, "logFile \"x.log\""),
            (
                r#"{"cniVersion":"1.0.0","name":"n","type":"t","prevResult":{"ips":[{"address":"x"}]}}"#,
                7,
                "prevResult: invalid CNI result: ips[0]",
            ),
            (
                r#"{"cniVersion":"1.0.0","name":"n","type":"t","cni.dev/valid-attachments":[{"ifname":"e"}]}"#,
                7,
                "missing field `containerID`",
            ),
        ];
        for (input, code, sub) in table {
            let e = NetConf::parse(input.as_bytes()).unwrap_err();
            assert_eq!(e.code, *code, "{input}: {e}");
            assert!(e.msg.contains(sub), "{input}: {e}");
        }
    }

    #[test]
    fn oversized_config_is_code_7_with_the_size() {
        let mut big = MINIMAL.as_bytes().to_vec();
        big.resize(MAX_CONFIG_BYTES + 10, b' ');
        let e = NetConf::parse(&big).unwrap_err();
        assert_eq!(e.code, 7);
        assert!(e.msg.contains("oversized config") && e.msg.contains(&format!("{}", MAX_CONFIG_BYTES + 10)), "{e}");
        // Exactly at the limit is fine.
        big.truncate(MAX_CONFIG_BYTES);
        NetConf::parse(&big).unwrap();
    }

    #[test]
    fn null_prev_result_is_absent() {
        let c = NetConf::parse(br#"{"cniVersion":"1.0.0","name":"n","type":"t","prevResult":null}"#).unwrap();
        assert_eq!(c.prev_result, None);
    }
}

//! The CNI error object (`{cniVersion, code, msg, details}`) and the well-known error codes.

use serde_json::{Map, Value};

use crate::CniVersion;

/// The error codes of CNI 1.1 ("Well-known Error Codes"). Codes 0-99 are reserved for these;
/// plugins use [`PLUGIN_SPECIFIC_MIN`] and above for their own.
///
/// Codes are plain `u32`s rather than an enum because an error read back from the binder (or from
/// a delegated plugin) must be printed with exactly the code it carries, including codes this
/// crate does not know.
pub mod code {
    /// Incompatible CNI version.
    pub const INCOMPATIBLE_VERSION: u32 = 1;
    /// Unsupported field in the network configuration; the message names the key and value.
    pub const UNSUPPORTED_FIELD: u32 = 2;
    /// Container unknown or does not exist: the runtime need not clean up (no DEL needed).
    pub const UNKNOWN_CONTAINER: u32 = 3;
    /// Invalid necessary environment variables; the message names them.
    pub const INVALID_ENVIRONMENT: u32 = 4;
    /// I/O failure, for example reading the configuration from stdin.
    pub const IO: u32 = 5;
    /// Failed to decode content, for example unparsable JSON on stdin.
    pub const DECODE: u32 = 6;
    /// Invalid network configuration.
    pub const INVALID_CONFIG: u32 = 7;
    /// A transient condition: the runtime should try again later.
    pub const TRY_AGAIN_LATER: u32 = 11;
    /// STATUS: the plugin cannot serve ADD requests.
    pub const NOT_AVAILABLE: u32 = 50;
    /// STATUS: not available, and existing containers may have limited connectivity.
    pub const LIMITED_CONNECTIVITY: u32 = 51;
    /// The first code free for plugin-specific errors.
    pub const PLUGIN_SPECIFIC_MIN: u32 = 100;

    /// A short name of a code, for logs and metric labels.
    pub fn name(code: u32) -> &'static str {
        match code {
            INCOMPATIBLE_VERSION => "incompatible_version",
            UNSUPPORTED_FIELD => "unsupported_field",
            UNKNOWN_CONTAINER => "unknown_container",
            INVALID_ENVIRONMENT => "invalid_environment",
            IO => "io",
            DECODE => "decode",
            INVALID_CONFIG => "invalid_config",
            TRY_AGAIN_LATER => "try_again_later",
            NOT_AVAILABLE => "not_available",
            LIMITED_CONNECTIVITY => "limited_connectivity",
            c if c >= PLUGIN_SPECIFIC_MIN => "plugin_specific",
            _ => "reserved",
        }
    }
}

pub use code::PLUGIN_SPECIFIC_MIN;

/// A CNI error: what a plugin prints on stdout, with a non-zero exit, when an operation fails.
///
/// `msg` is short and names what is wrong (the variable, the field, the socket); `details` holds
/// the longer story (an error chain), and is left out of the JSON when empty.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("CNI error {code} ({}): {msg}", code::name(*code))]
pub struct CniError {
    /// One of [`code`], or [`PLUGIN_SPECIFIC_MIN`] and above.
    pub code: u32,
    /// A short message characterising the error.
    pub msg: String,
    /// A longer description; empty when there is nothing to add.
    pub details: String,
}

impl CniError {
    /// An error with `code` and `msg` and no details.
    pub fn new(code: u32, msg: impl Into<String>) -> Self {
        Self { code, msg: msg.into(), details: String::new() }
    }

    /// The same error with `details` set.
    #[must_use]
    pub fn with_details(mut self, details: impl Into<String>) -> Self {
        self.details = details.into();
        self
    }

    /// Code 1: incompatible CNI version.
    pub fn incompatible_version(msg: impl Into<String>) -> Self {
        Self::new(code::INCOMPATIBLE_VERSION, msg)
    }

    /// Code 3: the container is unknown; nothing to clean up.
    pub fn unknown_container(msg: impl Into<String>) -> Self {
        Self::new(code::UNKNOWN_CONTAINER, msg)
    }

    /// Code 4: an invalid or missing `CNI_*` environment variable, named in `msg`.
    pub fn invalid_environment(msg: impl Into<String>) -> Self {
        Self::new(code::INVALID_ENVIRONMENT, msg)
    }

    /// Code 5: I/O failure.
    pub fn io(msg: impl Into<String>) -> Self {
        Self::new(code::IO, msg)
    }

    /// Code 6: content that cannot be decoded.
    pub fn decode(msg: impl Into<String>) -> Self {
        Self::new(code::DECODE, msg)
    }

    /// Code 7: an invalid network configuration.
    pub fn invalid_config(msg: impl Into<String>) -> Self {
        Self::new(code::INVALID_CONFIG, msg)
    }

    /// Code 11: try again later.
    pub fn try_again_later(msg: impl Into<String>) -> Self {
        Self::new(code::TRY_AGAIN_LATER, msg)
    }

    /// Code 50 (STATUS): the plugin cannot serve ADD now.
    pub fn not_available(msg: impl Into<String>) -> Self {
        Self::new(code::NOT_AVAILABLE, msg)
    }

    /// The spec's error object, `{"cniVersion", "code", "msg", "details"}`, in `version`.
    pub fn to_json(&self, version: CniVersion) -> Value {
        let mut m = Map::new();
        m.insert("cniVersion".into(), version.as_str().into());
        m.insert("code".into(), self.code.into());
        m.insert("msg".into(), self.msg.clone().into());
        if !self.details.is_empty() {
            m.insert("details".into(), self.details.clone().into());
        }
        Value::Object(m)
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn error_object_has_the_spec_keys() {
        let e = CniError::invalid_config("bad").with_details("longer");
        assert_eq!(
            e.to_json(CniVersion::V1_1_0),
            json!({"cniVersion": "1.1.0", "code": 7, "msg": "bad", "details": "longer"})
        );
        assert_eq!(
            CniError::new(142, "plugin").to_json(CniVersion::V0_3_1),
            json!({"cniVersion": "0.3.1", "code": 142, "msg": "plugin"})
        );
    }

    #[test]
    fn codes_have_their_spec_values() {
        let table = [
            (CniError::incompatible_version(""), 1),
            (CniError::new(code::UNSUPPORTED_FIELD, ""), 2),
            (CniError::unknown_container(""), 3),
            (CniError::invalid_environment(""), 4),
            (CniError::io(""), 5),
            (CniError::decode(""), 6),
            (CniError::invalid_config(""), 7),
            (CniError::try_again_later(""), 11),
            (CniError::not_available(""), 50),
            (CniError::new(code::LIMITED_CONNECTIVITY, ""), 51),
        ];
        for (e, want) in table {
            assert_eq!(e.code, want, "{e}");
            assert_ne!(code::name(e.code), "reserved");
        }
        assert_eq!(code::name(100), "plugin_specific");
        assert_eq!(code::name(42), "reserved");
    }

    #[test]
    fn display_names_code_and_message() {
        assert_eq!(CniError::io("read stdin").to_string(), "CNI error 5 (io): read stdin");
    }
}

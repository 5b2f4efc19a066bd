//! CNI specification versions, and the VERSION operation's answer.

use std::fmt;
use std::str::FromStr;

use serde::Deserialize;
use serde_json::{Value, json};

use crate::CniError;

/// A CNI specification version this crate can speak. The result layout differs between them:
/// 0.3.x and 0.4.0 tag each IP with `"version"`; 1.1.0 adds interface `mtu`, `socketPath`, `pciID`
/// and route `mtu`, `advmss`, `priority`, `table`, `scope`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum CniVersion {
    V0_3_0,
    V0_3_1,
    V0_4_0,
    V1_0_0,
    V1_1_0,
}

/// The versions supported, oldest first, as the VERSION operation reports them. 0.1.0 and 0.2.0
/// (the `ip4`/`ip6` result layout) are not: no runtime that can run kuryr still sends them.
pub const SUPPORTED_VERSIONS: [&str; 5] = ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"];

impl CniVersion {
    /// Every supported version, oldest first.
    pub const ALL: [CniVersion; 5] =
        [CniVersion::V0_3_0, CniVersion::V0_3_1, CniVersion::V0_4_0, CniVersion::V1_0_0, CniVersion::V1_1_0];

    /// The newest version: used when the input names none (or names one we do not speak).
    pub const LATEST: CniVersion = CniVersion::V1_1_0;

    /// The version as the spec spells it.
    pub const fn as_str(self) -> &'static str {
        match self {
            CniVersion::V0_3_0 => "0.3.0",
            CniVersion::V0_3_1 => "0.3.1",
            CniVersion::V0_4_0 => "0.4.0",
            CniVersion::V1_0_0 => "1.0.0",
            CniVersion::V1_1_0 => "1.1.0",
        }
    }

    /// Parses a `cniVersion`; an unsupported one is CNI error 1, naming it and the supported ones.
    pub fn parse(s: &str) -> Result<Self, CniError> {
        Self::ALL.into_iter().find(|v| v.as_str() == s).ok_or_else(|| {
            CniError::incompatible_version(format!(
                "unsupported cniVersion \"{s}\"; supported: {}",
                SUPPORTED_VERSIONS.join(", ")
            ))
        })
    }

    /// Whether each IP of a result carries `"version": "4" | "6"` (before 1.0.0).
    pub const fn ips_carry_version(self) -> bool {
        matches!(self, CniVersion::V0_3_0 | CniVersion::V0_3_1 | CniVersion::V0_4_0)
    }

    /// Whether results carry the 1.1.0 fields: interface `mtu`, `socketPath`, `pciID` and route
    /// `mtu`, `advmss`, `priority`, `table`, `scope`.
    pub const fn has_1_1_fields(self) -> bool {
        matches!(self, CniVersion::V1_1_0)
    }
}

impl fmt::Display for CniVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for CniVersion {
    type Err = CniError;

    fn from_str(s: &str) -> Result<Self, CniError> {
        Self::parse(s)
    }
}

#[derive(Deserialize)]
struct VersionOnly {
    #[serde(rename = "cniVersion")]
    cni_version: Option<String>,
}

/// The `cniVersion` of a configuration if it can be read and is supported, without validating
/// anything else: the version to print an error in when the configuration itself is the problem.
pub fn requested_version(config: &[u8]) -> Option<CniVersion> {
    let v: VersionOnly = serde_json::from_slice(config).ok()?;
    CniVersion::parse(v.cni_version.as_deref()?).ok()
}

/// The VERSION operation: stdin is `{"cniVersion": ...}` (or empty). The answer echoes the
/// requested version when it is supported and otherwise names [`CniVersion::LATEST`], so that a
/// runtime probing with a version we do not speak still learns what we do; only stdin that is not
/// JSON fails (code 6).
pub fn version_result(stdin: &[u8]) -> Result<Value, CniError> {
    let version = if stdin.iter().all(u8::is_ascii_whitespace) {
        CniVersion::LATEST
    } else {
        let v: VersionOnly = serde_json::from_slice(stdin)
            .map_err(|e| CniError::decode(format!("cannot decode the VERSION request: {e}")))?;
        v.cni_version.as_deref().and_then(|s| CniVersion::parse(s).ok()).unwrap_or(CniVersion::LATEST)
    };
    Ok(json!({"cniVersion": version.as_str(), "supportedVersions": SUPPORTED_VERSIONS}))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_round_trip_and_order() {
        for (v, s) in CniVersion::ALL.into_iter().zip(SUPPORTED_VERSIONS) {
            assert_eq!(v.as_str(), s);
            assert_eq!(CniVersion::parse(s).unwrap(), v);
            assert_eq!(s.parse::<CniVersion>().unwrap(), v);
        }
        assert!(CniVersion::V0_3_0 < CniVersion::V1_1_0);
        assert_eq!(CniVersion::LATEST, *CniVersion::ALL.last().unwrap());
    }

    #[test]
    fn unsupported_version_is_code_1_naming_it_and_the_supported_ones() {
        for bad in ["0.2.0", "0.1.0", "2.0.0", "1.1", ""] {
            let e = CniVersion::parse(bad).unwrap_err();
            assert_eq!(e.code, 1);
            assert!(e.msg.contains(&format!("\"{bad}\"")), "{e}");
            assert!(e.msg.contains("0.3.0, 0.3.1, 0.4.0, 1.0.0, 1.1.0"), "{e}");
        }
    }

    #[test]
    fn version_result_echoes_supported_versions_and_falls_back_to_latest() {
        let all = json!(["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"]);
        let table: &[(&[u8], &str)] = &[
            (br#"{"cniVersion":"0.3.0"}"#, "0.3.0"),
            (br#"{"cniVersion":"0.3.1"}"#, "0.3.1"),
            (br#"{"cniVersion":"0.4.0"}"#, "0.4.0"),
            (br#"{"cniVersion":"1.0.0"}"#, "1.0.0"),
            (br#"{"cniVersion":"1.1.0"}"#, "1.1.0"),
            (br#"{"cniVersion":"9.9.9"}"#, "1.1.0"),
            (br#"{}"#, "1.1.0"),
            (b"", "1.1.0"),
            (b" \n", "1.1.0"),
        ];
        for (stdin, want) in table {
            let got = version_result(stdin).unwrap();
            assert_eq!(
                got,
                json!({"cniVersion": want, "supportedVersions": all}),
                "{}",
                String::from_utf8_lossy(stdin)
            );
        }
        assert_eq!(version_result(b"{nope").unwrap_err().code, 6);
    }

    #[test]
    fn requested_version_is_lenient() {
        assert_eq!(requested_version(br#"{"cniVersion":"0.4.0","name":5}"#), Some(CniVersion::V0_4_0));
        assert_eq!(requested_version(br#"{"cniVersion":4}"#), None);
        assert_eq!(requested_version(br#"{"cniVersion":"7.0.0"}"#), None);
        assert_eq!(requested_version(b"garbage"), None);
    }
}

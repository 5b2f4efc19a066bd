//! The CNI operations (`CNI_COMMAND`), the environment each one requires, and the checks on
//! `CNI_CONTAINERID` and `CNI_IFNAME`.

use std::fmt;

use crate::CniError;

/// The names of the CNI environment variables.
pub mod env {
    pub const COMMAND: &str = "CNI_COMMAND";
    pub const CONTAINERID: &str = "CNI_CONTAINERID";
    pub const NETNS: &str = "CNI_NETNS";
    pub const IFNAME: &str = "CNI_IFNAME";
    pub const ARGS: &str = "CNI_ARGS";
    pub const PATH: &str = "CNI_PATH";
}

/// A CNI operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Command {
    Add,
    Del,
    Check,
    Status,
    Gc,
    Version,
}

impl Command {
    /// Parses `CNI_COMMAND` (upper case, as the spec spells it); anything else is code 4.
    pub fn parse(s: &str) -> Result<Self, CniError> {
        Ok(match s {
            "ADD" => Command::Add,
            "DEL" => Command::Del,
            "CHECK" => Command::Check,
            "STATUS" => Command::Status,
            "GC" => Command::Gc,
            "VERSION" => Command::Version,
            other => {
                return Err(CniError::invalid_environment(format!(
                    "{} has the unknown value \"{other}\"; expected ADD, DEL, CHECK, STATUS, GC or VERSION",
                    env::COMMAND
                )));
            }
        })
    }

    /// The operation as `CNI_COMMAND` spells it.
    pub const fn as_str(self) -> &'static str {
        match self {
            Command::Add => "ADD",
            Command::Del => "DEL",
            Command::Check => "CHECK",
            Command::Status => "STATUS",
            Command::Gc => "GC",
            Command::Version => "VERSION",
        }
    }

    /// The environment variables CNI 1.1 requires for this operation (non-empty).
    ///
    /// `CNI_PATH` is required only by GC: the spec lists it as optional for ADD, DEL, CHECK and
    /// STATUS, and the kuryr plugin delegates to no other plugin, so it has no use for it there.
    /// `CNI_NETNS` is optional for DEL: the runtime may have removed the namespace already.
    pub const fn required_env(self) -> &'static [&'static str] {
        match self {
            Command::Add | Command::Check => &[env::COMMAND, env::CONTAINERID, env::NETNS, env::IFNAME],
            Command::Del => &[env::COMMAND, env::CONTAINERID, env::IFNAME],
            Command::Gc => &[env::COMMAND, env::PATH],
            Command::Status | Command::Version => &[env::COMMAND],
        }
    }

    /// Whether the operation concerns one attachment (`CNI_CONTAINERID` + `CNI_IFNAME`).
    pub const fn is_per_attachment(self) -> bool {
        matches!(self, Command::Add | Command::Del | Command::Check)
    }
}

impl fmt::Display for Command {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Checks `CNI_CONTAINERID` as the spec defines it: non-empty, starting with an ASCII
/// alphanumeric, followed by alphanumerics, `_`, `.` or `-`. Code 4 otherwise.
pub fn validate_container_id(id: &str) -> Result<(), CniError> {
    let mut chars = id.chars();
    let ok = chars.next().is_some_and(|c| c.is_ascii_alphanumeric())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'));
    if ok {
        Ok(())
    } else {
        Err(CniError::invalid_environment(format!(
            "{} \"{id}\" is invalid: it must start with a letter or digit, followed by letters, digits, '_', '.' or '-'",
            env::CONTAINERID
        )))
    }
}

/// The longest interface name Linux accepts (IFNAMSIZ - 1).
pub const MAX_IFNAME_LEN: usize = 15;

/// Checks `CNI_IFNAME` against what Linux accepts as an interface name: 1-15 bytes, not `.` or
/// `..`, without `/`, `:` or whitespace. Code 4 otherwise.
pub fn validate_ifname(name: &str) -> Result<(), CniError> {
    let problem = if name.is_empty() {
        Some("is empty")
    } else if name.len() > MAX_IFNAME_LEN {
        Some("is longer than 15 bytes")
    } else if name == "." || name == ".." {
        Some("is not a valid name")
    } else if name.chars().any(|c| c == '/' || c == ':' || c.is_whitespace()) {
        Some("contains '/', ':' or whitespace")
    } else {
        None
    };
    match problem {
        None => Ok(()),
        Some(p) => Err(CniError::invalid_environment(format!("{} \"{name}\" {p}", env::IFNAME))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_round_trip() {
        for c in [Command::Add, Command::Del, Command::Check, Command::Status, Command::Gc, Command::Version] {
            assert_eq!(Command::parse(c.as_str()).unwrap(), c);
            assert_eq!(c.required_env()[0], env::COMMAND);
        }
        let e = Command::parse("add").unwrap_err();
        assert_eq!(e.code, 4);
        assert!(e.msg.contains("CNI_COMMAND") && e.msg.contains("\"add\""), "{e}");
    }

    #[test]
    fn required_env_follows_the_spec() {
        assert_eq!(Command::Add.required_env(), &["CNI_COMMAND", "CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME"]);
        assert_eq!(Command::Check.required_env(), Command::Add.required_env());
        assert_eq!(Command::Del.required_env(), &["CNI_COMMAND", "CNI_CONTAINERID", "CNI_IFNAME"]);
        assert_eq!(Command::Gc.required_env(), &["CNI_COMMAND", "CNI_PATH"]);
        assert_eq!(Command::Status.required_env(), &["CNI_COMMAND"]);
        assert_eq!(Command::Version.required_env(), &["CNI_COMMAND"]);
    }

    #[test]
    fn container_ids() {
        for ok in ["a", "0123abcdef", "pod_1.x-y", "A"] {
            validate_container_id(ok).unwrap();
        }
        for bad in ["", "-a", "_a", ".a", "a b", "a/b", "a:b", "é"] {
            let e = validate_container_id(bad).unwrap_err();
            assert_eq!(e.code, 4);
            assert!(e.msg.contains("CNI_CONTAINERID"), "{e}");
        }
    }

    #[test]
    fn ifnames() {
        for ok in ["eth0", "a", "net1.100", "123456789012345"] {
            validate_ifname(ok).unwrap();
        }
        for bad in ["", ".", "..", "1234567890123456", "a/b", "a:b", "a b", "a\tb"] {
            let e = validate_ifname(bad).unwrap_err();
            assert_eq!(e.code, 4);
            assert!(e.msg.contains("CNI_IFNAME"), "{e}");
        }
    }
}

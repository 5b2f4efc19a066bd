//! What the runtime hands the shim: the `CNI_*` environment and stdin, read and checked before
//! anything talks to the binder.

use std::ffi::OsString;
use std::io::{self, Read};

use kuryr_cni_types::{
    CniArgs, CniError, Command, MAX_CONFIG_BYTES, NetConf, env, validate_container_id, validate_ifname,
};

/// Reads one environment variable. `std::env::var_os` in the binary; a map in tests, so that no
/// test mutates the process environment.
pub type EnvLookup<'a> = &'a dyn Fn(&str) -> Option<OsString>;

/// Stdin as read: at most [`MAX_CONFIG_BYTES`] are kept.
#[derive(Debug)]
pub enum Stdin {
    /// The whole of stdin.
    Read(Vec<u8>),
    /// Stdin was larger than the limit; it was read to the end (so the runtime's writer does not
    /// fail) and only counted.
    Oversized(u64),
    /// Reading failed.
    Failed(io::Error),
}

impl Stdin {
    /// Reads `r` to its end, keeping at most [`MAX_CONFIG_BYTES`].
    pub fn read_from(mut r: impl Read) -> Stdin {
        let mut buf = Vec::new();
        let limit = MAX_CONFIG_BYTES as u64 + 1;
        if let Err(e) = r.by_ref().take(limit).read_to_end(&mut buf) {
            return Stdin::Failed(e);
        }
        if (buf.len() as u64) < limit {
            return Stdin::Read(buf);
        }
        match io::copy(&mut r, &mut io::sink()) {
            Ok(rest) => Stdin::Oversized(limit + rest),
            Err(e) => Stdin::Failed(e),
        }
    }

    /// The bytes, or the CNI error for stdin that is unreadable (5) or too large (7).
    pub fn bytes(&self) -> Result<&[u8], CniError> {
        match self {
            Stdin::Read(b) => Ok(b),
            Stdin::Oversized(n) => NetConf::check_size(*n).map(|()| &[][..]),
            Stdin::Failed(e) => Err(CniError::io(format!("cannot read the network configuration from stdin: {e}"))),
        }
    }
}

/// The `CNI_*` variables of one invocation, checked for the operation. Optional variables that are
/// unset read as empty.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Invocation {
    pub command: Command,
    pub container_id: String,
    pub netns: String,
    pub ifname: String,
    pub args: String,
    pub path: String,
}

impl Invocation {
    /// `CNI_COMMAND` alone: missing, empty or unknown is code 4.
    pub fn command(lookup: EnvLookup<'_>) -> Result<Command, CniError> {
        let c = var(lookup, env::COMMAND)?;
        if c.is_empty() {
            return Err(missing(&[env::COMMAND]));
        }
        Command::parse(&c)
    }

    /// Reads the variables `command` uses and checks them: every variable the spec requires for it
    /// must be set and non-empty (code 4 naming all that are not), and for ADD, DEL and CHECK the
    /// container id, interface name and `CNI_ARGS` must be well-formed (code 4).
    pub fn from_env(command: Command, lookup: EnvLookup<'_>) -> Result<Self, CniError> {
        let inv = Invocation {
            command,
            container_id: var(lookup, env::CONTAINERID)?,
            netns: var(lookup, env::NETNS)?,
            ifname: var(lookup, env::IFNAME)?,
            args: var(lookup, env::ARGS)?,
            path: var(lookup, env::PATH)?,
        };
        let absent: Vec<&str> = command.required_env().iter().copied().filter(|v| inv.get(v).is_empty()).collect();
        if !absent.is_empty() {
            return Err(missing(&absent));
        }
        if command.is_per_attachment() {
            validate_container_id(&inv.container_id)?;
            validate_ifname(&inv.ifname)?;
            CniArgs::parse(&inv.args)?;
        }
        Ok(inv)
    }

    fn get(&self, var: &str) -> &str {
        match var {
            env::COMMAND => self.command.as_str(),
            env::CONTAINERID => &self.container_id,
            env::NETNS => &self.netns,
            env::IFNAME => &self.ifname,
            env::ARGS => &self.args,
            env::PATH => &self.path,
            _ => "",
        }
    }
}

fn var(lookup: EnvLookup<'_>, name: &str) -> Result<String, CniError> {
    match lookup(name) {
        None => Ok(String::new()),
        Some(v) => v.into_string().map_err(|_| CniError::invalid_environment(format!("{name} is not valid UTF-8"))),
    }
}

fn missing(vars: &[&str]) -> CniError {
    let (noun, list) = if vars.len() == 1 { ("variable", vars[0].to_string()) } else { ("variables", vars.join(", ")) };
    CniError::invalid_environment(format!("missing or empty environment {noun}: {list}"))
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn lookup(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<OsString> {
        let m: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k| m.get(k).map(OsString::from)
    }

    const FULL: &[(&str, &str)] = &[
        ("CNI_COMMAND", "ADD"),
        ("CNI_CONTAINERID", "abc123"),
        ("CNI_NETNS", "/var/run/netns/x"),
        ("CNI_IFNAME", "eth0"),
        ("CNI_ARGS", "IgnoreUnknown=1;K8S_POD_NAME=p"),
        ("CNI_PATH", "/opt/cni/bin"),
    ];

    fn without(cmd: &str, drop: &[&str]) -> Vec<(&'static str, String)> {
        FULL.iter()
            .filter(|(k, _)| !drop.contains(k))
            .map(|(k, v)| (*k, if *k == "CNI_COMMAND" { cmd.to_string() } else { v.to_string() }))
            .collect()
    }

    fn check(cmd: &str, drop: &[&str]) -> Result<Invocation, CniError> {
        let pairs = without(cmd, drop);
        let pairs: Vec<(&str, &str)> = pairs.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let l = lookup(&pairs);
        let command = Invocation::command(&l)?;
        Invocation::from_env(command, &l)
    }

    #[test]
    fn full_environment_reads_back() {
        let inv = check("ADD", &[]).unwrap();
        assert_eq!(inv.command, Command::Add);
        assert_eq!(
            (inv.container_id.as_str(), inv.netns.as_str(), inv.ifname.as_str(), inv.path.as_str()),
            ("abc123", "/var/run/netns/x", "eth0", "/opt/cni/bin")
        );
    }

    #[test]
    fn each_required_variable_is_named_when_missing() {
        for cmd in ["ADD", "DEL", "CHECK", "STATUS", "GC", "VERSION"] {
            let command = Command::parse(cmd).unwrap();
            for var in ["CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME", "CNI_PATH", "CNI_ARGS"] {
                let res = check(cmd, &[var]);
                if command.required_env().contains(&var) {
                    let e = res.unwrap_err();
                    assert_eq!(e.code, 4, "{cmd} {var}");
                    assert!(e.msg.ends_with(var), "{cmd} {var}: {e}");
                } else if var == "CNI_ARGS" || !command.is_per_attachment() {
                    res.unwrap();
                } else {
                    // Optional, but checked when present (CNI_NETNS for DEL may be absent).
                    assert!(res.is_ok(), "{cmd} without {var}: {res:?}");
                }
            }
        }
    }

    #[test]
    fn del_accepts_an_empty_netns() {
        let pairs = [("CNI_COMMAND", "DEL"), ("CNI_CONTAINERID", "abc"), ("CNI_IFNAME", "eth0"), ("CNI_NETNS", "")];
        let l = lookup(&pairs);
        assert_eq!(Invocation::from_env(Command::Del, &l).unwrap().netns, "");
    }

    #[test]
    fn all_missing_variables_are_listed() {
        let e = check("ADD", &["CNI_NETNS", "CNI_IFNAME"]).unwrap_err();
        assert_eq!(e.msg, "missing or empty environment variables: CNI_NETNS, CNI_IFNAME");
        let e = check("ADD", &["CNI_COMMAND"]).unwrap_err();
        assert_eq!((e.code, e.msg.as_str()), (4, "missing or empty environment variable: CNI_COMMAND"));
    }

    #[test]
    fn malformed_values_are_code_4() {
        let table: &[(&str, &str, &str)] = &[
            ("CNI_COMMAND", "FROB", "CNI_COMMAND"),
            ("CNI_CONTAINERID", "-bad", "CNI_CONTAINERID"),
            ("CNI_IFNAME", "a/b", "CNI_IFNAME"),
            ("CNI_ARGS", "K8S_POD_NAME", "malformed pair \"K8S_POD_NAME\""),
        ];
        for (var, value, want) in table {
            let mut pairs: Vec<(&str, &str)> = FULL.iter().filter(|(k, _)| k != var).copied().collect();
            pairs.push((var, value));
            let l = lookup(&pairs);
            let e = Invocation::command(&l).and_then(|c| Invocation::from_env(c, &l)).unwrap_err();
            assert_eq!(e.code, 4, "{var}={value}");
            assert!(e.msg.contains(want), "{var}={value}: {e}");
        }
    }

    #[test]
    fn stdin_is_read_whole_or_counted() {
        let small = Stdin::read_from(&b"{}"[..]);
        assert_eq!(small.bytes().unwrap(), b"{}");
        let at_limit = vec![b' '; MAX_CONFIG_BYTES];
        assert_eq!(Stdin::read_from(&at_limit[..]).bytes().unwrap().len(), MAX_CONFIG_BYTES);
        let big = vec![b' '; MAX_CONFIG_BYTES * 3 + 7];
        let s = Stdin::read_from(&big[..]);
        assert!(matches!(s, Stdin::Oversized(n) if n == big.len() as u64), "{s:?}");
        let e = s.bytes().unwrap_err();
        assert_eq!(e.code, 7);
        assert!(e.msg.contains(&big.len().to_string()), "{e}");
        let e = Stdin::Failed(io::Error::other("boom")).bytes().unwrap_err();
        assert_eq!(e.code, 5);
    }
}

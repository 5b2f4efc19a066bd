//! An address with a prefix length, as CNI results carry them (`"10.1.0.5/16"`).

use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

/// An IP address and prefix length. Unlike a network, the host bits are kept: a CNI `address` is
/// the interface's own address together with its subnet's length.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct IpCidr {
    addr: IpAddr,
    prefix: u8,
}

impl IpCidr {
    /// `addr/prefix`, or `None` when the prefix is too long for the address family.
    pub fn new(addr: IpAddr, prefix: u8) -> Option<Self> {
        let max = if addr.is_ipv4() { 32 } else { 128 };
        (prefix <= max).then_some(Self { addr, prefix })
    }

    /// The address.
    pub fn addr(&self) -> IpAddr {
        self.addr
    }

    /// The prefix length.
    pub fn prefix(&self) -> u8 {
        self.prefix
    }

    /// `"4"` or `"6"`, as the 0.3.x/0.4.0 result layout tags IPs.
    pub fn family(&self) -> &'static str {
        family(self.addr)
    }
}

/// `"4"` or `"6"`.
pub(crate) fn family(addr: IpAddr) -> &'static str {
    if addr.is_ipv4() { "4" } else { "6" }
}

impl fmt::Display for IpCidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

/// A string equals an `IpCidr` when it parses to the same address and prefix, so that
/// `"FD00::5/64"` equals `fd00::5/64`: comparing with what `ip addr` or a VIF reports needs no
/// canonical spelling.
impl PartialEq<str> for IpCidr {
    fn eq(&self, other: &str) -> bool {
        other.parse::<IpCidr>().is_ok_and(|c| c == *self)
    }
}

impl PartialEq<&str> for IpCidr {
    fn eq(&self, other: &&str) -> bool {
        *self == **other
    }
}

impl PartialEq<String> for IpCidr {
    fn eq(&self, other: &String) -> bool {
        *self == *other.as_str()
    }
}

impl PartialEq<IpCidr> for String {
    fn eq(&self, other: &IpCidr) -> bool {
        *other == *self.as_str()
    }
}

impl PartialEq<IpCidr> for &str {
    fn eq(&self, other: &IpCidr) -> bool {
        *other == **self
    }
}

/// Why a string is not `ADDRESS/PREFIX`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("\"{0}\" is not an address in CIDR notation (like 10.1.0.5/16 or fd00::5/64)")]
pub struct ParseCidrError(String);

impl FromStr for IpCidr {
    type Err = ParseCidrError;

    fn from_str(s: &str) -> Result<Self, ParseCidrError> {
        let bad = || ParseCidrError(s.to_string());
        let (addr, prefix) = s.split_once('/').ok_or_else(bad)?;
        if prefix.is_empty() || !prefix.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        let addr: IpAddr = addr.parse().map_err(|_| bad())?;
        let prefix: u8 = prefix.parse().map_err(|_| bad())?;
        IpCidr::new(addr, prefix).ok_or_else(bad)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints() {
        for (input, out, fam) in [
            ("10.1.0.5/16", "10.1.0.5/16", "4"),
            ("0.0.0.0/0", "0.0.0.0/0", "4"),
            ("fd00::5/64", "fd00::5/64", "6"),
            ("FD00:0:0::5/128", "fd00::5/128", "6"),
            ("::/0", "::/0", "6"),
        ] {
            let c: IpCidr = input.parse().unwrap();
            assert_eq!(c.to_string(), out);
            assert_eq!(c.family(), fam);
        }
    }

    #[test]
    fn compares_with_strings_by_value() {
        let c: IpCidr = "fd00::5/64".parse().unwrap();
        assert!(c == "FD00:0::5/64");
        let owned = String::from("fd00::5/64");
        assert!(owned == c);
        assert!(c == owned);
        assert!("fd00::5/64" == c);
        assert!(c != "fd00::5/65");
        assert!(c != "junk");
    }

    #[test]
    fn rejects() {
        for bad in ["10.1.0.5", "10.1.0.5/", "10.1.0.5/33", "fd00::/129", "10.1.0.5/+1", "x/8", "/8", "10.1.0.5/16/2"] {
            let e = bad.parse::<IpCidr>().unwrap_err();
            assert!(e.to_string().contains(bad), "{e}");
        }
    }
}

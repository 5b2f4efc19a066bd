//! Which ServiceAccounts may call which methods: a table from method path to the accounts
//! allowed, deny by default. Being a kuryr service is not enough — any pod can get a token for
//! its own ServiceAccount with any audience, so the rules name the accounts, never "anyone
//! authenticated".

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;

use tonic::Status;

use super::Account;

/// A ServiceAccount, `namespace:name` (or the username form `system:serviceaccount:ns:name`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct AccountRef {
    pub namespace: String,
    pub name: String,
}

impl AccountRef {
    /// `namespace/name`'s account.
    pub fn new(namespace: &str, name: &str) -> Self {
        Self { namespace: namespace.to_string(), name: name.to_string() }
    }

    /// Whether `account` is this one.
    pub fn matches(&self, account: &Account) -> bool {
        self.namespace == account.namespace && self.name == account.name
    }
}

impl fmt::Display for AccountRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.namespace, self.name)
    }
}

impl FromStr for AccountRef {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim();
        let t = t.strip_prefix("system:serviceaccount:").unwrap_or(t);
        let (ns, name) = t.split_once(':').ok_or_else(|| format!("`{s}`: expected NAMESPACE:SERVICEACCOUNT"))?;
        let valid = |p: &str| {
            !p.is_empty()
                && p.len() <= 253
                && p.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        };
        if !valid(ns) || !valid(name) {
            return Err(format!("`{s}`: namespace and name must be DNS names, as in kuryr-system:kuryr-binder"));
        }
        Ok(Self::new(ns, name))
    }
}

/// Method path → the accounts that may call it.
#[derive(Clone, Debug, Default)]
pub struct Rules {
    methods: HashMap<String, Vec<AccountRef>>,
}

impl Rules {
    /// No method allowed to anyone.
    pub fn new() -> Self {
        Self::default()
    }

    /// Lets `accounts` call `service`'s `methods` (`kuryr.allocator.v1.VifAllocator`, `WatchVifs`).
    #[must_use]
    pub fn allow(mut self, service: &str, methods: &[&str], accounts: &[AccountRef]) -> Self {
        for m in methods {
            self.methods.entry(format!("/{service}/{m}")).or_default().extend(accounts.iter().cloned());
        }
        self
    }

    /// PERMISSION_DENIED unless `account` may call `path`.
    pub fn check(&self, path: &str, account: &Account) -> Result<(), Status> {
        match self.methods.get(path) {
            Some(allowed) if allowed.iter().any(|a| a.matches(account)) => Ok(()),
            Some(_) => Err(Status::permission_denied(format!("{account} may not call {path}"))),
            None => Err(Status::permission_denied(format!("{path}: no caller may use this method"))),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn acct(ns: &str, name: &str) -> Account {
        Account { namespace: ns.into(), name: name.into(), node: None, pod: None }
    }

    #[test]
    fn parses_both_forms() {
        assert_eq!(
            "kuryr-system:kuryr-binder".parse::<AccountRef>().unwrap(),
            AccountRef::new("kuryr-system", "kuryr-binder")
        );
        assert_eq!("system:serviceaccount:a:b".parse::<AccountRef>().unwrap(), AccountRef::new("a", "b"));
        for bad in ["", "a", ":b", "a:", "A:b", "a:b c", "a/b"] {
            assert!(bad.parse::<AccountRef>().is_err(), "{bad}");
        }
    }

    #[test]
    fn deny_by_default_and_by_account() {
        let binder = AccountRef::new("kuryr-system", "kuryr-binder");
        let r = Rules::new().allow("kuryr.allocator.v1.VifAllocator", &["WatchVifs", "ReportPlugged"], &[binder]);
        assert!(r.check("/kuryr.allocator.v1.VifAllocator/WatchVifs", &acct("kuryr-system", "kuryr-binder")).is_ok());
        let e = r.check("/kuryr.allocator.v1.VifAllocator/WatchVifs", &acct("default", "kuryr-binder")).unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        let e = r.check("/kuryr.allocator.v1.PoolManager/FreePool", &acct("kuryr-system", "kuryr-binder")).unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        assert!(e.message().contains("no caller"), "{}", e.message());
    }
}

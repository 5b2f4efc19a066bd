//! Request validation at the gRPC edge, shared by every service: each check names the offending
//! field and answers INVALID_ARGUMENT (PERMISSION_DENIED for [`own_node`]).

use tonic::Status;

use crate::auth::Caller;

/// A resume point is ~40 bytes; anything longer was not handed out by a kuryr stream.
pub const MAX_RESUME_FROM: usize = 128;
/// Subscriber and binder ids, node names: a DNS subdomain's length.
pub const MAX_NAME: usize = 253;

/// An RFC 1123 label: namespaces, Service names, each part of a node name.
#[must_use]
pub fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// An RFC 1123 subdomain: node names.
#[must_use]
pub fn is_dns_subdomain(s: &str) -> bool {
    s.len() <= MAX_NAME && s.split('.').all(is_dns_label)
}

/// `field` must hold something other than white space.
pub fn required(field: &str, value: &str) -> Result<(), Status> {
    if value.trim().is_empty() {
        return Err(Status::invalid_argument(format!("{field}: required")));
    }
    Ok(())
}

/// `field` must be a DNS label; `what` names it in the error ("namespace name").
pub fn dns_label(field: &str, value: &str, what: &str) -> Result<(), Status> {
    required(field, value)?;
    if !is_dns_label(value) {
        return Err(Status::invalid_argument(format!("{field}: `{value}` is not a valid {what}")));
    }
    Ok(())
}

/// `field` must be a node name (a DNS subdomain).
pub fn node_name(field: &str, value: &str) -> Result<(), Status> {
    required(field, value)?;
    if !is_dns_subdomain(value) {
        return Err(Status::invalid_argument(format!("{field}: `{value}` is not a valid node name")));
    }
    Ok(())
}

/// A stream's `resume_from`: empty, or a resume point passed back as received.
pub fn resume_from(value: &str) -> Result<(), Status> {
    if value.len() > MAX_RESUME_FROM || value.chars().any(char::is_control) {
        return Err(Status::invalid_argument(format!(
            "resume_from: at most {MAX_RESUME_FROM} bytes of printable text; pass a resume_point back exactly as received"
        )));
    }
    Ok(())
}

/// Who a stream's subscriber says it is, for logs and metrics (`field`: `subscriber`, `binder_id`).
pub fn subscriber(field: &str, value: &str) -> Result<(), Status> {
    if value.len() > MAX_NAME || value.chars().any(char::is_control) {
        return Err(Status::invalid_argument(format!(
            "{field}: at most {MAX_NAME} bytes of printable text (for example \"binder/node-1\")"
        )));
    }
    Ok(())
}

/// PERMISSION_DENIED when the caller's credentials are bound to a node other than `node`: a
/// binder acts for, and reads, its own node only. Callers bound to no node (an operator's token,
/// `--auth none`) are not held to one.
pub fn own_node(caller: Option<&Caller>, field: &str, node: &str) -> Result<(), Status> {
    match caller.and_then(Caller::node) {
        Some(bound) if bound != node => Err(Status::permission_denied(format!(
            "{field}: `{node}` is not the node this caller's token is bound to ({bound})"
        ))),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        for ok in ["a", "node-1", "x1", &"a".repeat(63)] {
            assert!(is_dns_label(ok), "{ok}");
        }
        for bad in ["", "-a", "a-", "A", "a_b", "a.b", &"a".repeat(64)] {
            assert!(!is_dns_label(bad), "{bad}");
        }
        assert!(is_dns_subdomain("node-1.example.com"));
        assert!(!is_dns_subdomain("node..1"));
        assert!(!is_dns_subdomain(&format!("{}.b", "a".repeat(252))));
    }

    #[test]
    fn errors_name_the_field() {
        let e = node_name("node_name", "Node_1").unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert!(e.message().starts_with("node_name: `Node_1`"), "{}", e.message());
        assert_eq!(required("pod_uid", " ").unwrap_err().message(), "pod_uid: required");
        assert!(dns_label("namespace", "ns", "namespace name").is_ok());
        assert!(dns_label("namespace", "", "namespace name").unwrap_err().message().ends_with("required"));
        assert!(resume_from("").is_ok());
        assert!(resume_from(&"x".repeat(129)).unwrap_err().message().starts_with("resume_from:"));
        assert!(resume_from("a\nb").is_err());
        assert!(subscriber("binder_id", "binder/n1").is_ok());
        assert!(subscriber("binder_id", "a\u{7}").unwrap_err().message().starts_with("binder_id:"));
    }

    #[test]
    fn a_node_bound_caller_acts_for_its_node_only() {
        use crate::auth::Account;
        let bound = |node: Option<&str>| {
            Caller::Account(Account {
                namespace: "kuryr-system".into(),
                name: "kuryr-binder".into(),
                node: node.map(Into::into),
                pod: None,
            })
        };
        assert!(own_node(Some(&bound(Some("n1"))), "node_name", "n1").is_ok());
        let e = own_node(Some(&bound(Some("n1"))), "node_name", "n2").unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        assert!(e.message().starts_with("node_name:") && e.message().contains("(n1)"), "{}", e.message());
        // Not bound to a node (an operator's token), or not checked: not held to one.
        assert!(own_node(Some(&bound(None)), "node_name", "n2").is_ok());
        assert!(own_node(Some(&Caller::Unchecked), "node_name", "n2").is_ok());
        assert!(own_node(None, "node_name", "n2").is_ok());
    }
}

//! Conversions to and from `kuryr.binder.v1` (feature `proto`): results, errors, and the gRPC
//! status that carries a [`CniError`] from the binder to the shim.

use kuryr_proto::binder::v1 as pb;
use prost::Message;

use crate::cidr::IpCidr;
use crate::result::{check_index, parse_gateway};
use crate::{CniError, CniResult, Dns, Interface, InvalidResult, IpConfig, Route, code};

/// Into the proto form. The proto carries no `socketPath`, `pciID` or 1.1.0 route attributes:
/// kuryr's VIFs have none of them, so they are dropped.
impl From<&CniResult> for pb::CniResult {
    fn from(r: &CniResult) -> Self {
        pb::CniResult {
            interfaces: r
                .interfaces
                .iter()
                .map(|i| pb::Interface {
                    name: i.name.clone(),
                    mac: i.mac.clone().unwrap_or_default(),
                    mtu: i.mtu.unwrap_or_default(),
                    sandbox: i.sandbox.clone().unwrap_or_default(),
                })
                .collect(),
            ips: r
                .ips
                .iter()
                .map(|ip| pb::IpConfig {
                    address: ip.address.to_string(),
                    gateway: ip.gateway.map(|g| g.to_string()).unwrap_or_default(),
                    interface: ip.interface,
                })
                .collect(),
            routes: r
                .routes
                .iter()
                .map(|rt| pb::Route { dst: rt.dst.to_string(), gw: rt.gw.map(|g| g.to_string()).unwrap_or_default() })
                .collect(),
            dns: (!r.dns.is_empty()).then(|| pb::Dns {
                nameservers: r.dns.nameservers.clone(),
                domain: r.dns.domain.clone().unwrap_or_default(),
                search: r.dns.search.clone(),
                options: r.dns.options.clone(),
            }),
        }
    }
}

/// From the proto form, checked as [`CniResult::from_value`] checks JSON.
impl TryFrom<&pb::CniResult> for CniResult {
    type Error = InvalidResult;

    fn try_from(p: &pb::CniResult) -> Result<Self, InvalidResult> {
        let some = |s: &str| (!s.is_empty()).then(|| s.to_string());
        let interfaces: Vec<Interface> = p
            .interfaces
            .iter()
            .map(|i| Interface {
                name: i.name.clone(),
                mac: some(&i.mac),
                mtu: (i.mtu != 0).then_some(i.mtu),
                sandbox: some(&i.sandbox),
                socket_path: None,
                pci_id: None,
            })
            .collect();
        let mut ips = Vec::with_capacity(p.ips.len());
        for (n, ip) in p.ips.iter().enumerate() {
            let at = |m: String| InvalidResult(format!("ips[{n}]: {m}"));
            let address: IpCidr = ip.address.parse().map_err(|e| at(format!("address: {e}")))?;
            let gateway = parse_gateway(&ip.gateway, address.addr()).map_err(|e| at(format!("gateway: {e}")))?;
            check_index(ip.interface, interfaces.len()).map_err(at)?;
            ips.push(IpConfig { address, gateway, interface: ip.interface });
        }
        let mut routes = Vec::with_capacity(p.routes.len());
        for (n, r) in p.routes.iter().enumerate() {
            let at = |m: String| InvalidResult(format!("routes[{n}]: {m}"));
            let dst: IpCidr = r.dst.parse().map_err(|e| at(format!("dst: {e}")))?;
            let gw = parse_gateway(&r.gw, dst.addr()).map_err(|e| at(format!("gw: {e}")))?;
            routes.push(Route::new(dst, gw));
        }
        let dns = p
            .dns
            .as_ref()
            .map(|d| Dns {
                nameservers: d.nameservers.clone(),
                domain: some(&d.domain),
                search: d.search.clone(),
                options: d.options.clone(),
            })
            .unwrap_or_default();
        Ok(CniResult { interfaces, ips, routes, dns })
    }
}

impl From<&CniError> for pb::CniError {
    fn from(e: &CniError) -> Self {
        pb::CniError { code: e.code, msg: e.msg.clone(), details: e.details.clone() }
    }
}

impl From<pb::CniError> for CniError {
    fn from(e: pb::CniError) -> Self {
        CniError { code: e.code, msg: e.msg, details: e.details }
    }
}

impl CniError {
    /// The gRPC code a binder should fail with for this error, so that a client that cannot read
    /// the details still maps it back to the same CNI code: 1 → FAILED_PRECONDITION, 3 →
    /// NOT_FOUND, 2/4/6/7 → INVALID_ARGUMENT, 11/50/51 → UNAVAILABLE, anything else → INTERNAL.
    pub fn grpc_code(&self) -> tonic::Code {
        match self.code {
            code::INCOMPATIBLE_VERSION => tonic::Code::FailedPrecondition,
            code::UNKNOWN_CONTAINER => tonic::Code::NotFound,
            code::UNSUPPORTED_FIELD | code::INVALID_ENVIRONMENT | code::DECODE | code::INVALID_CONFIG => {
                tonic::Code::InvalidArgument
            }
            code::TRY_AGAIN_LATER | code::NOT_AVAILABLE | code::LIMITED_CONNECTIVITY => tonic::Code::Unavailable,
            _ => tonic::Code::Internal,
        }
    }

    /// The encoded `kuryr.binder.v1.CniError`, for `Status::with_details`.
    pub fn to_status_details(&self) -> Vec<u8> {
        pb::CniError::from(self).encode_to_vec()
    }

    /// The `CniError` a status carries in its details, if it carries one (a non-zero code).
    pub fn from_status(status: &tonic::Status) -> Option<CniError> {
        let d = status.details();
        if d.is_empty() {
            return None;
        }
        pb::CniError::decode(d).ok().filter(|e| e.code != 0).map(CniError::from)
    }
}

/// The status a binder returns: [`CniError::grpc_code`], `msg` as the message, and the error in
/// the details, where the shim reads it back exactly.
impl From<CniError> for tonic::Status {
    fn from(e: CniError) -> Self {
        let details = e.to_status_details();
        tonic::Status::with_details(e.grpc_code(), e.msg, details.into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> CniResult {
        CniResult::from_value(&serde_json::json!({
            "interfaces": [{"name": "tap1", "mac": "fe:00:00:00:00:01", "mtu": 1450}, {"name": "eth0", "sandbox": "/run/netns/x"}],
            "ips": [{"address": "10.0.0.5/24", "gateway": "10.0.0.1", "interface": 1}, {"address": "fd00::5/64"}],
            "routes": [{"dst": "0.0.0.0/0", "gw": "10.0.0.1"}, {"dst": "fd00:1::/64"}],
            "dns": {"nameservers": ["10.0.0.2"], "search": ["svc.cluster.local"]},
        }))
        .unwrap()
    }

    #[test]
    fn result_round_trips_through_proto() {
        let p = pb::CniResult::from(&sample());
        assert_eq!(p.interfaces[0].mtu, 1450);
        assert_eq!(p.interfaces[0].sandbox, "");
        assert_eq!(p.ips[0].gateway, "10.0.0.1");
        assert_eq!(p.ips[1].interface, None);
        assert_eq!(CniResult::try_from(&p).unwrap(), sample());
        assert_eq!(pb::CniResult::from(&CniResult::default()).dns, None);
    }

    #[test]
    fn invalid_proto_results_are_refused() {
        let mut p = pb::CniResult::from(&sample());
        p.ips[0].interface = Some(7);
        assert!(CniResult::try_from(&p).unwrap_err().0.contains("out of range"));
        let mut p = pb::CniResult::from(&sample());
        p.routes[0].gw = "fd00::1".into();
        assert!(CniResult::try_from(&p).unwrap_err().0.contains("routes[0]: gw"));
        let mut p = pb::CniResult::from(&sample());
        p.ips[0].address = "10.0.0.5".into();
        assert!(CniResult::try_from(&p).unwrap_err().0.contains("ips[0]: address"));
    }

    #[test]
    fn error_travels_in_status_details() {
        let e = CniError::new(103, "plugin trouble").with_details("the whole story");
        let s = tonic::Status::from(e.clone());
        assert_eq!(s.code(), tonic::Code::Internal);
        assert_eq!(s.message(), "plugin trouble");
        assert_eq!(CniError::from_status(&s), Some(e));
        assert_eq!(CniError::from_status(&tonic::Status::unavailable("x")), None);
        let junk = tonic::Status::with_details(tonic::Code::Internal, "x", vec![0xff, 0xff].into());
        assert_eq!(CniError::from_status(&junk), None);
    }

    #[test]
    fn grpc_codes_map_back_to_the_same_cni_code() {
        for (cni, grpc) in [
            (1, tonic::Code::FailedPrecondition),
            (2, tonic::Code::InvalidArgument),
            (3, tonic::Code::NotFound),
            (4, tonic::Code::InvalidArgument),
            (5, tonic::Code::Internal),
            (6, tonic::Code::InvalidArgument),
            (7, tonic::Code::InvalidArgument),
            (11, tonic::Code::Unavailable),
            (50, tonic::Code::Unavailable),
            (51, tonic::Code::Unavailable),
            (100, tonic::Code::Internal),
        ] {
            assert_eq!(CniError::new(cni, "").grpc_code(), grpc, "{cni}");
        }
    }
}
